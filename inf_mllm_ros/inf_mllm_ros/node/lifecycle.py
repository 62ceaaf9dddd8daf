"""The ROS 2 node: camera frames and text in, answers, descriptions and cache figures out.

A thin lifecycle node over `StreamingEngine`, which runs the model on its own worker thread:

- configure loads the model, activate takes input, deactivate stops input and saves the memory,
  cleanup frees the model; with `autostart` (the default) the node configures and activates itself;
- subscription and timer callbacks only convert messages and hand them to the engine (never block);
- `~/query`, `~/recall`, `~/reset` and `~/save_memory` wait for the engine in callback groups of their own,
  so a multi-threaded executor keeps serving topics, timers and parameters while the model works;
- whatever the engine reports from its worker (an input done, a description) goes through a queue
  and a guard condition, so that publishing and logging happen on the executor;
- `~/query` and `~/recall` take `max_pending_queries` requests at a time; the rest wait untaken in the
  services' deep middleware history (SERVICE_QOS), so a burst of callers is answered at the model's pace,
  never dropped and never refused for a full queue;
- on SIGINT or SIGTERM the node stops the model, saves the memory and answers every caller still
  waiting ("node is shutting down") before it leaves the graph.

The node owns its parts, one module each: node/inputs.py (`Inputs`: frames, texts, the outbox of engine
reports, descriptions), node/services.py (`Services`: the services and the action) and node/health.py (`Health`:
`~/cache_stats`, `/diagnostics`); node/parameters.py declares and checks the parameters. This module wires them,
holds the lifecycle and applies a parameter change to whatever reads it. The node uses the engine through
`EngineLike` (node/engine_interface.py). The process that runs it (one node, or one per memory on a shared model) is
node/process.py: `ros2 run inf_mllm_ros inf_mllm_node`.
"""

from __future__ import annotations

import threading
import time
from typing import Callable

from rcl_interfaces.msg import SetParametersResult
from rclpy.callback_groups import MutuallyExclusiveCallbackGroup
from rclpy.lifecycle import LifecycleNode, LifecycleState, TransitionCallbackReturn

from ..engine.api import EngineNotReadyError
from .engine_interface import EngineLike
from .health import Health, NodeCounters
from .inputs import Inputs
from .parameters import change_problem, declare_parameters
from .services import Services
from .state import NodeState
from ..settings import (BY_NAME, PARAMETERS, frame_period, live_engine_changes, load_settings, model_threads,
                       stream_config)

NODE_NAME = "inf_mllm"
# Seconds a shutdown or cleanup waits for the model: it stops within one block or token, then saves.
ENGINE_CLOSE_TIMEOUT = 30.0


class InfMLLMNode(LifecycleNode):
    """Camera and text into one bounded memory; questions answered from it. A lifecycle node:

    - unconfigured: parameters and services only; a question is answered "not configured";
    - configure: builds the engine and loads the model (services answer "model is still loading" meanwhile,
      `~/cache_stats` says `model_ready` false); fails, with the reason logged, if the model cannot load;
    - activate: subscribes to the camera and text and starts the description timer;
    - deactivate: stops taking input and saves the memory to `memory_file`; the memory stays loaded;
    - cleanup: saves the memory and frees the model.

    engine_factory builds the engine from the parameters (StreamingEngine's signature; None: StreamingEngine, imported
    at the first configure, so that a node that is refused at start or waits unconfigured never loads torch); tests may
    pass their own. The node owns its parts (`inputs`, `service_handlers`, `health`) and what it hands them: the
    state they read (`node_state`, node/state.py: the engine, `active`, `stopping`, `autostarting`,
    `lifecycle_state`), `param` and the counters they write (`counters`).
    """

    def __init__(self, node_name: str = NODE_NAME, *, engine_factory: Callable[..., EngineLike] | None = None,
                 **kwargs):
        super().__init__(node_name, **kwargs)
        declare_parameters(self)
        self._engine_factory = engine_factory
        # What the parts share of the node's state, handed to them with the rclpy node and the parameters.
        self.node_state = NodeState(autostarting=bool(self.param("autostart")))
        self._periodic: dict[str, object] = {}  # the description and stats timers (see _set_timer)
        self.counters = NodeCounters()
        self.health = Health(self, self.node_state, self.param, self.counters)
        self.inputs = Inputs(self, self.node_state, self.param, self.counters, self.health.publish_stats)
        self.health.watch(self.inputs.health)
        self.service_handlers = Services(self, self.node_state, self.param, self.counters, self.inputs)
        self.add_on_set_parameters_callback(self._on_set_parameters)

    def param(self, name: str):
        return self.get_parameter(name).value

    # The node's state, as its parts see it (NodeState); the node changes it through `node_state`.
    @property
    def engine(self) -> EngineLike | None:
        return self.node_state.engine

    @property
    def active(self) -> bool:
        return self.node_state.active

    @property
    def lifecycle_state(self) -> str:
        return self.node_state.lifecycle_state

    @property
    def autostarting(self) -> bool:
        return self.node_state.autostarting

    @property
    def stopping(self) -> threading.Event:
        return self.node_state.stopping

    @property
    def services_busy(self) -> int:
        """Service and action callbacks running now (each has a caller waiting for its response)."""
        return self.service_handlers.services_busy

    # --- parameters -----------------------------------------------------------------------------------------
    def _on_set_parameters(self, params) -> SetParametersResult:
        problem = change_problem(params, self.param("eviction_policy"))
        if problem:
            return SetParametersResult(successful=False, reason=problem)
        # Before configure the parameter alone changes: configure reads it. After, the engine takes its part of
        # the change in one call, checked whole, and applies it between two jobs.
        if self.engine is not None:
            change = live_engine_changes({p.name: p.value for p in params})
            if change:
                try:
                    self.engine.update_settings(**change)
                except ValueError as exc:
                    return SetParametersResult(successful=False, reason=str(exc))
        for p in params:
            if p.name == "frame_rate":
                self.inputs.set_frame_rate(p.value)
            elif p.name == "description_period" and self.active:
                self._set_timer("description", p.value)
            elif p.name == "stats_period" and self.health.stats_open:
                self._set_timer("stats", p.value)
            elif p.name == "diagnostics_period":
                self.health.set_diagnostics_period(p.value)
            if p.name in BY_NAME:
                self.get_logger().info(f"{p.name} set to {p.value!r}")
        return SetParametersResult(successful=True)

    def _set_timer(self, name: str, period: float) -> None:
        """(Re)create a periodic timer of `period` seconds; 0: none."""
        old = self._periodic.pop(name, None)
        if old is not None:
            self.destroy_timer(old)
        if name == "description":
            self.inputs.descriptions_restarted()
        if period > 0.0:
            callback = {"description": self.inputs.on_description_timer, "stats": self.health.publish_stats}[name]
            # A group each, as each input has (node/inputs.py, `subscribe`): the description's is the reports'.
            group = self.inputs.reports_group if name == "description" else MutuallyExclusiveCallbackGroup()
            self._periodic[name] = self.create_timer(period, callback, callback_group=group)

    # --- lifecycle ------------------------------------------------------------------------------------------
    def _transition(self, result: TransitionCallbackReturn, success: str, failure: str) -> TransitionCallbackReturn:
        """Remember the lifecycle state a transition leads to (what /diagnostics reports), and pass its result on."""
        self.node_state.lifecycle_state = success if result == TransitionCallbackReturn.SUCCESS else failure
        return result

    def on_configure(self, state: LifecycleState) -> TransitionCallbackReturn:
        return self._transition(self._configure(), "inactive", "unconfigured")

    def on_activate(self, state: LifecycleState) -> TransitionCallbackReturn:
        return self._transition(self._activate(state), "active", "inactive")

    def on_deactivate(self, state: LifecycleState) -> TransitionCallbackReturn:
        return self._transition(self._deactivate(state), "inactive", "active")

    def on_cleanup(self, state: LifecycleState) -> TransitionCallbackReturn:
        result = TransitionCallbackReturn.SUCCESS if self._release() else TransitionCallbackReturn.FAILURE
        return self._transition(result, "unconfigured", "inactive")

    def on_shutdown(self, state: LifecycleState) -> TransitionCallbackReturn:
        self.stopping.set()
        self._release()
        return self._transition(TransitionCallbackReturn.SUCCESS, "finalized", "finalized")

    def on_error(self, state: LifecycleState) -> TransitionCallbackReturn:
        self._release()
        return self._transition(TransitionCallbackReturn.SUCCESS, "unconfigured", "finalized")

    def _configure(self) -> TransitionCallbackReturn:
        if not self._release():  # what a failed configure or cleanup left
            return TransitionCallbackReturn.FAILURE
        self.health.open_stats()
        self.inputs.open_descriptions()
        self._set_timer("stats", self.param("stats_period"))
        try:
            values = {p.name: self.param(p.name) for p in PARAMETERS}
            config = stream_config(values)
            self.get_logger().info(
                f"loading model {self.param('model')!r} (cache {config.capacity} tokens, policy {config.policy}"
                + "".join(f", {k} {v}" for k, v in config.policy_settings.items()) + ")")
            started = time.monotonic()
            self.node_state.engine = (self._engine_factory or streaming_engine())(
                self._fetch_model(values), config, **load_settings(values),
                max_pending_texts=self.param("max_pending_texts"),
                max_pending_queries=self.param("max_pending_queries"),
                on_ingested=lambda kind: self.inputs.post("ingested", kind),
                memory_file=self.param("memory_file") or None,
                checkpoint_period=self.param("checkpoint_period"),
                frame_period=frame_period(self.param("frame_rate")),
                max_text_delay=self.param("max_text_delay"),
                torch_threads=model_threads(values),
            )
        except Exception as exc:  # rclpy would swallow it: say why here
            self._say_error(f"configure failed: {type(exc).__name__}: {exc}")
            self.get_logger().error(self.counters.last_error)
            self.health.publish_stats()
            return TransitionCallbackReturn.FAILURE
        self.health.publish_stats()
        # The engine signals readiness; meanwhile the services answer "model is still loading".
        try:
            self.engine.wait_ready()
        except EngineNotReadyError as exc:
            self._say_error(str(exc))
            self.get_logger().error(f"{exc}; configure failed (queries answer success=false with this reason)")
            self.health.publish_stats()
            return TransitionCallbackReturn.FAILURE
        # Times go on from a restored memory's clock: its first input was stream time 0.
        self.inputs.restart_clock(self.engine.time_origin)
        if self.engine.pose_frame:  # a restored memory's poses are in its frame: new ones must be too
            if self.param("pose_frame") and self.param("pose_frame") != self.engine.pose_frame:
                self.get_logger().warning(f"the memory keeps its poses in {self.engine.pose_frame!r}; pose_frame "
                                          f"{self.param('pose_frame')!r} is not used")
            self.inputs.keep_pose_frame(self.engine.pose_frame)
        self._report_ready(time.monotonic() - started)
        return TransitionCallbackReturn.SUCCESS

    def _fetch_model(self, values: dict):
        """The `model` parameter, a hub id made its local folder: from the hub cache, or downloaded with the bytes
        done and in all in the log (every 10 %) and on /diagnostics (engine/models/hub.py)."""
        logged = [-1]

        def progress(done: int, total: int) -> None:
            self.node_state.model_download = f"downloading model: {done / 1e6:.1f} of {total / 1e6:.1f} MB"
            tenth = 10 * done // total if total else 10
            if tenth > logged[0]:
                logged[0] = tenth
                self.get_logger().info(self.node_state.model_download)

        try:
            from ..engine.models.loading import fetch_model  # the model's machinery, once a model is wanted

            model = fetch_model(values["model"], values["model_revision"],
                                trust_remote_code=values["trust_remote_code"], progress=progress)
        finally:
            self.node_state.model_download = ""
        if model != values["model"]:
            self.get_logger().info(f"model {values['model']!r} is the folder {model}")
        return model

    def _report_ready(self, seconds: float) -> None:
        prepared = self.engine.preparation
        self.get_logger().info(f"model ready in {seconds:.1f} s" + (
            " (prepared for the first question: " + ", ".join(f"{name.replace('_', ' ')} {value:.2f} s"
                                                              for name, value in prepared.items()) + ")"
            if prepared else ""))
        if self.engine.memory_file is not None:
            refused = "refused" in self.engine.memory_status
            (self.get_logger().warning if refused else self.get_logger().info)(self.engine.memory_status)
        adapter = self.engine.adapter
        notice = adapter.notice if adapter is not None else ""
        if notice:  # the embedded default: say plainly that its frame descriptions mean nothing
            self.get_logger().warning(notice)
        self.health.publish_stats()

    def _activate(self, state: LifecycleState) -> TransitionCallbackReturn:
        if self.engine is not None and self.engine.closed:  # kept by a cleanup that failed: it takes no more input
            self.get_logger().error("cannot activate: the model is closed (a cleanup is pending); clean up first")
            return TransitionCallbackReturn.FAILURE
        self.inputs.subscribe()
        self._set_timer("description", self.param("description_period"))
        self.node_state.active = True
        self.get_logger().info("active: taking camera frames and texts")
        self.health.publish_stats()
        return super().on_activate(state)

    def _deactivate(self, state: LifecycleState) -> TransitionCallbackReturn:
        self.node_state.active = False
        self.inputs.unsubscribe()
        self._set_timer("description", 0.0)
        self.health.publish_stats()
        if self.engine is not None and self.engine.memory_file is not None:
            try:
                info = self.engine.submit_save().result(timeout=self.param("query_timeout"))
                self.get_logger().info(f"inactive; memory saved to {info.path} ({info.fill} tokens held)")
            except Exception as exc:
                self.get_logger().error(f"inactive; saving the memory failed: {exc}")
        else:
            self.get_logger().info("inactive: input is no longer taken; the memory is kept")
        return super().on_deactivate(state)

    def _release(self) -> bool:
        """Stop taking input, save and free the model, and drop the publishers (back to unconfigured). False
        if the model is still busy after ENGINE_CLOSE_TIMEOUT: the engine is then kept, closed, so that no
        new one loads the memory file while this one may still save it (a later configure or cleanup tries
        again)."""
        self.node_state.active = False
        self.inputs.unsubscribe()
        for name in list(self._periodic):
            self._set_timer(name, 0.0)
        if self.engine is not None:
            if not self._close_engine():
                return False
            self.node_state.engine = None
        self.health.close_stats()
        self.inputs.close_descriptions()
        return True

    @property
    def executor_threads(self) -> int:
        # The running query and every waiting one hold a thread, a reset and a save may hold one more each, and
        # two keep topics, timers and quick refusals going.
        return self.param("max_pending_queries") + 5

    def end_autostart(self) -> None:
        """Autostart's configure and activate are over (succeeded or not): callers hear the lifecycle's state now."""
        self.node_state.autostarting = False

    def close(self) -> None:
        """Refuse new queries and stop the model: every caller still waiting is answered "node is shutting down".

        The engine fails what waits and stops its current answer at the next token; this waits for that, so
        that the process never exits while the worker thread is inside the model.
        """
        self.stopping.set()
        if self.engine is not None:
            self._close_engine()

    def destroy_node(self) -> None:
        services = getattr(self, "service_handlers", None)  # absent if the constructor failed before it
        if services is not None:
            services.destroy()
        inputs = getattr(self, "inputs", None)
        if inputs is not None:  # a node shut down while active: its inputs' threads end before the process does
            inputs.unsubscribe()
        super().destroy_node()

    def _say_error(self, message: str) -> None:
        with self.counters.lock:
            self.counters.last_error = message

    def _close_engine(self) -> bool:
        """Close the engine; whether its worker has ended (it stops within a block or a token, then saves)."""
        ended = self.engine.close(timeout=ENGINE_CLOSE_TIMEOUT) is not False
        if not ended:
            self.get_logger().error(f"the model is still busy after {ENGINE_CLOSE_TIMEOUT:g} s; its memory is not "
                                    "saved yet")
            return False
        saved, failed = self.engine.last_saved, self.engine.save_error
        if failed:
            self.get_logger().error(f"memory NOT saved: {failed}" + (
                f"; the file holds the save of {saved.tokens_seen} tokens seen" if saved is not None else ""))
        elif saved is not None:
            self.get_logger().info(f"memory saved to {saved.path}: {saved.fill} tokens held, {saved.tokens_seen} seen")
        return True


def streaming_engine() -> Callable[..., EngineLike]:
    """The engine a node builds unless told otherwise: `StreamingEngine`, imported when first wanted (with torch)."""
    from ..engine.runtime.engine import StreamingEngine

    return StreamingEngine
