"""The node's services and action: `~/query`, `~/recall`, `~/reset`, `~/save_memory` and `~/ask`.

`Services` is a part the node (node/lifecycle.py) owns. The services exist in every lifecycle state, so a
caller always hears why not instead of nothing, and they wait for the engine in callback groups of their
own, so a multi-threaded executor keeps serving topics, timers and parameters while the model works. Every
caller gets a response: a refusal in the node's state, a timeout, a failure of the model and a shutdown
each say so in `message`.

`~/query` and `~/recall` share a `BoundedCallbackGroup` of `max_pending_queries` slots: the node takes that
many questions at once (the one answered and those waiting for the model), and the rest wait, untaken, in the
services' middleware history (SERVICE_QOS), to be taken one by one as answers end. So no burst of responses
is ever made for a burst of callers: answers leave at the model's pace, none is refused for a full queue, and
each caller's process has time to read them (docs/node.md, Many callers).
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import TimeoutError as FutureTimeoutError
from contextlib import contextmanager

from rclpy.action import ActionServer, CancelResponse, GoalResponse
from rclpy.callback_groups import ReentrantCallbackGroup
from rclpy.lifecycle import LifecycleNode
from rclpy.qos import DurabilityPolicy, HistoryPolicy, QoSProfile, ReliabilityPolicy
from std_srvs.srv import Trigger

from inf_mllm_interfaces.action import Ask
from inf_mllm_interfaces.srv import Query, Recall

from ..engine.api import (AnswerCancelledError, EngineBusyError, EngineNotReadyError, TextRefused, checked_text,
                          recall_problem)
from .engine_interface import EngineLike
from .executor import BoundedCallbackGroup
from ..input_rules import stamp_seconds
from .health import NodeCounters
from .inputs import Inputs
from .state import NodeState, ParameterReader
from .markers import EvidenceMarkers
from .poses import evidence_msgs
from ..settings import MAX_NEW_TOKENS_LIMIT

# Services: the requests that wait to be taken, and the responses. Questions beyond max_pending_queries wait
# here, untaken (a request costs its bytes), so the history is deep: with the default depth (10) the middleware
# would drop the requests of a burst, and their callers would never hear back.
SERVICE_QOS = QoSProfile(history=HistoryPolicy.KEEP_LAST, depth=1000, reliability=ReliabilityPolicy.RELIABLE,
                         durability=DurabilityPolicy.VOLATILE)
# Refusals leave at least this far apart; answers are never held. Every client of a service receives every
# response it sends and drops those for other clients (Fast DDS: one reply topic per service), so a burst of
# instant responses fills a default client's history (10 deep) in each calling process and pushes out a
# caller's own response before that process takes it. Questions are answered at the model's pace, but a
# burst of callers while the model loads, or while the node is inactive or stopping, is refused at once: spaced,
# 100 refusals take a second.
REFUSAL_SPACING = 0.01
SHUTTING_DOWN = "node is shutting down"
NOT_CONFIGURED = "node is not configured: no model is loaded (configure it through its lifecycle)"
LOADING = "model is still loading"
INACTIVE = "node is inactive: it takes no input and answers no question until it is activated"
# Moments a recall gives when the request asks for 0 (at most MAX_RECALL_RESULTS: engine/value_rules.py).
DEFAULT_RECALL_RESULTS = 5


class Services:
    """The services and the action, each handler counted in flight while it runs (so that shutdown waits
    for its caller), and control jobs (reset, save) one of each kind at a time.

    ros: the rclpy node it serves on. state: the node's (its engine, whether it is active, autostarting or
    stopping). param: reads the node's parameters. counters: the node's. inputs: the node's inputs (stream time,
    the pose frame, the cameras, the outbox).
    """

    def __init__(self, ros: LifecycleNode, state: NodeState, param: ParameterReader, counters: NodeCounters,
                 inputs: Inputs):
        self.ros, self.state, self.param, self.counters, self.inputs = ros, state, param, counters, inputs
        node = ros
        self._lock = threading.Lock()
        self._in_service = 0  # service and action callbacks running now
        self._next_refusal_at = 0.0  # monotonic time before which no refusal leaves (see REFUSAL_SPACING)
        self.controls_waiting: set[str] = set()  # "reset", "saved": one of each at a time
        # Services exist in every state, so a caller always hears why not instead of nothing.
        waiting = ReentrantCallbackGroup()
        # Questions taken at once: the one answered and those waiting for the model, one place fewer than the
        # engine's queue holds (max_pending_queries waiting beside the one answered), so that a goal of ~/ask
        # finds room beside a burst. The rest wait in the middleware, untaken, and query_timeout counts from
        # when a request is taken.
        self.questions = BoundedCallbackGroup(param("max_pending_queries"))
        node.create_service(Query, "~/query", self._on_query, callback_group=self.questions,
                            qos_profile=SERVICE_QOS)
        node.create_service(Recall, "~/recall", lambda req, res: self._served(self._recall, req, res),
                            callback_group=self.questions, qos_profile=SERVICE_QOS)
        # The last answer's evidence poses, heaviest first, for RViz.
        self.markers = EvidenceMarkers(node)  # while active only
        node.create_service(Trigger, "~/reset", self._on_reset, callback_group=waiting, qos_profile=SERVICE_QOS)
        node.create_service(Trigger, "~/save_memory", self._on_save_memory, callback_group=waiting,
                            qos_profile=SERVICE_QOS)
        # Every goal is accepted, so that each one ends with a result that says why when it fails.
        self._ask_server = ActionServer(
            node, Ask, "~/ask", execute_callback=self._execute_ask, callback_group=waiting,
            goal_callback=lambda _goal: GoalResponse.ACCEPT, cancel_callback=lambda _goal: CancelResponse.ACCEPT)

    def destroy(self) -> None:
        self._ask_server.destroy()

    @property
    def services_busy(self) -> int:
        """Service and action callbacks running now (each has a caller waiting for its response)."""
        with self._lock:
            return self._in_service

    @contextmanager
    def _serving(self):
        with self._lock:
            self._in_service += 1
        try:
            yield
        finally:
            with self._lock:
                self._in_service -= 1

    def _served(self, handler, request, response):
        """Run a service handler counted as in flight; a failure during shutdown says so."""
        with self._serving():
            try:
                response = handler(request, response)
            except Exception as exc:  # every caller gets a response, whatever went wrong
                self.ros.get_logger().error(f"request failed: {type(exc).__name__}: {exc}")
                response.success, response.message = False, f"internal error: {type(exc).__name__}: {exc}"
            if not response.success:
                if self.state.stopping.is_set():
                    response.message = SHUTTING_DOWN
                self._space_refusal()
            return response

    def _space_refusal(self) -> None:
        """Wait for this refusal's turn to leave, REFUSAL_SPACING after the one before."""
        with self._lock:
            now = time.monotonic()
            at = max(now, self._next_refusal_at)
            self._next_refusal_at = at + REFUSAL_SPACING
        if at > now:
            time.sleep(at - now)

    def _on_query(self, request: Query.Request, response: Query.Response) -> Query.Response:
        return self._served(self._ask_engine, request, response)

    def _ask_engine(self, request, response, on_token=None, cancel: threading.Event | None = None,
                    cancelled=lambda: False):
        """Answer a Query request or an Ask goal into its response or result (the same fields)."""
        start = time.monotonic()
        engine = self.state.engine
        unusable = self._lifecycle_refusal(engine, ask=True)
        if unusable:
            return self._query_failed(response, unusable)
        max_new = request.max_new_tokens or self.param("max_new_tokens")
        try:  # bounded in length too: a kept question goes in whole before its answer, and must stop soon
            question = checked_text(request.question, "question", self.param("max_text_chars"))
        except TextRefused as exc:
            return self._query_failed(response, str(exc))
        if max_new > MAX_NEW_TOKENS_LIMIT:
            return self._query_failed(response, f"max_new_tokens {max_new} is above the limit {MAX_NEW_TOKENS_LIMIT}")
        timeout = self.param("query_timeout")
        try:
            future = engine.submit_ask(question, max_new_tokens=max_new, keep_in_memory=request.keep_in_memory,
                                       on_token=on_token, cancel=cancel, asked_at=self.inputs.now_stream_time())
        except EngineNotReadyError as exc:
            return self._query_failed(response, str(exc))
        deadline = time.monotonic() + timeout
        try:
            while cancel is not None:  # an action goal: watch for a cancel request while waiting
                try:
                    answer = future.result(timeout=0.05)
                    break
                except FutureTimeoutError:
                    if cancelled():
                        cancel.set()  # a running answer stops at its next token
                        if future.cancel():  # one still waiting never starts: counted here, not by the engine
                            return self._query_failed(response, "cancelled")
                    elif time.monotonic() >= deadline:
                        raise
            else:
                answer = future.result(timeout=timeout)
        except FutureTimeoutError:
            if cancel is not None:
                cancel.set()
            reason = f"no answer within query_timeout ({timeout:g} s): the model is busy"
            if engine.abandon(future):  # running: the engine counts it failed when it ends, never answered
                response.success, response.message = False, reason
                return response
            return self._query_failed(response, reason)  # never started: the worker skips it
        except AnswerCancelledError:
            response.success, response.message = False, "cancelled"
            return response
        except (EngineNotReadyError, EngineBusyError, ValueError) as exc:
            # The engine counted these itself.
            response.success, response.message = False, str(exc)
            return response
        except Exception as exc:
            response.success, response.message = False, f"model error: {type(exc).__name__}: {exc}"
            with self.counters.lock:
                self.counters.last_error = response.message
            return response
        response.success = True
        response.answer = answer.text
        if answer.cut_by_headroom:
            response.message = (f"answer cut at {answer.tokens_generated} tokens of {max_new}: the cache's headroom "
                                "bounds an answer not kept in memory (keep_in_memory lifts the bound)")
        response.newest_frame_stamp = self.inputs.ros_time(answer.newest_frame_stamp)
        response.tokens_seen = answer.tokens_seen
        response.cache_fill = answer.cache_fill
        response.retrieved_tokens = answer.retrieved_tokens
        response.evidence = evidence_msgs(answer.evidence, self.inputs.ros_time, self.inputs.pose_frame)
        response.time_note = answer.time_note
        self.markers.answered(answer.evidence, self.inputs.pose_frame, self.inputs.ros_time)
        response.latency = time.monotonic() - start
        return response

    def _recall(self, request: Recall.Request, response: Recall.Response) -> Recall.Response:
        """~/recall: the moments a text points to most, as evidence, without an answer."""
        start = time.monotonic()
        engine = self.state.engine
        unusable = self._lifecycle_refusal(engine, ask=True)
        problem = unusable
        if not problem:
            try:
                text = checked_text(request.text, "recall text", self.param("max_text_chars"))
            except TextRefused as exc:
                problem = str(exc)
        # Radius 0: anywhere (a request's default); any other radius is the rule's to judge.
        near = None if request.radius == 0.0 else (request.x, request.y, request.radius)
        limit = request.max_results or DEFAULT_RECALL_RESULTS
        origin = self.inputs.time_origin
        since, until = (None if (t.sec, t.nanosec) == (0, 0) or origin is None else stamp_seconds(t, 0) - origin
                        for t in (request.since, request.until))
        if not problem:
            problem = recall_problem(limit, since, until, near, request.camera)
        if not problem and request.camera and request.camera not in self.inputs.camera_names:
            problem = (f"no camera {request.camera!r}: this node's cameras are "
                       f"{', '.join(self.inputs.camera_names) or 'one, unnamed'}")
        if problem:
            response.success, response.message = False, problem
            return response
        timeout = self.param("query_timeout")
        try:
            future = engine.submit_recall(text, limit=limit, since=since, until=until, near=near,
                                          camera=request.camera)
            moments = future.result(timeout=timeout)
        except FutureTimeoutError:
            engine.abandon(future)
            response.success, response.message = False, f"no answer within query_timeout ({timeout:g} s): the model " \
                                                         "is busy"
            return response
        except (EngineNotReadyError, EngineBusyError, ValueError) as exc:
            response.success, response.message = False, str(exc)
            return response
        response.success = True
        response.moments = evidence_msgs(moments, self.inputs.ros_time, self.inputs.pose_frame)
        self.markers.recalled(moments, self.inputs.pose_frame, self.inputs.ros_time)
        response.latency = time.monotonic() - start
        return response

    def _execute_ask(self, goal_handle) -> Ask.Result:
        """The ~/ask action: the answer so far as feedback after each token; cancel stops it at the next one."""
        def feedback(text: str, n: int) -> None:
            goal_handle.publish_feedback(Ask.Feedback(partial_answer=text, tokens_generated=n))

        def answer(request, result: Ask.Result) -> Ask.Result:
            return self._ask_engine(request, result, on_token=feedback, cancel=threading.Event(),
                                    cancelled=lambda: goal_handle.is_cancel_requested)

        with self._serving():  # in flight until the goal's end is out, so that shutdown waits for it
            result = self._served(answer, goal_handle.request, Ask.Result())
            if result.success:
                goal_handle.succeed()
            elif result.message == "cancelled" and goal_handle.is_cancel_requested:
                goal_handle.canceled()
            else:
                goal_handle.abort()
            return result

    def _lifecycle_refusal(self, engine: EngineLike | None, *, ask: bool) -> str | None:
        """Why a request cannot be served in the node's state, or None: the same words from every service.
        A question also needs the node active; one asked while the model loads hears why from the engine,
        which counts it."""
        state = self.state
        if state.stopping.is_set():
            return SHUTTING_DOWN
        if engine is None:
            return LOADING if state.autostarting else NOT_CONFIGURED
        if not engine.ready.is_set():
            if ask:
                return None
            return f"model failed to load: {engine.load_error}" if engine.load_error else LOADING
        if ask and not state.active:
            return LOADING if state.autostarting else INACTIVE
        return None

    def _query_failed(self, response: Query.Response, reason: str) -> Query.Response:
        with self.counters.lock:
            self.counters.queries_failed += 1
        response.success, response.message = False, reason
        return response

    def _on_reset(self, request: Trigger.Request, response: Trigger.Response) -> Trigger.Response:
        return self._served(self._clear, request, response)

    def _clear(self, _request: Trigger.Request, response: Trigger.Response) -> Trigger.Response:
        engine = self.state.engine
        refusal = self._lifecycle_refusal(engine, ask=False)
        if refusal:
            response.success, response.message = False, refusal
            return response
        done, _ = self._wait_control(engine.submit_reset, response, "reset")
        if not done:
            return response
        self.inputs.clear_poses("memory reset")
        self.inputs.post("ingested", "reset")  # stats and descriptions follow the empty memory
        response.success, response.message = True, "memory cleared"
        return response

    def _wait_control(self, submit, response, verb: str) -> tuple[bool, object]:
        """Run a control job of the engine (reset, save) within query_timeout; on failure `response` says why.
        One of each kind waits at a time: each holds an executor thread while it waits (see executor_threads)."""
        timeout = self.param("query_timeout")
        with self._lock:
            if verb in self.controls_waiting:
                response.success, response.message = False, f"not {verb}: another request for it is under way"
                return False, None
            self.controls_waiting.add(verb)
        try:
            future = submit()
            return True, future.result(timeout=timeout)
        except FutureTimeoutError:
            # Not started yet: it never will be. Already running: it completes, and the caller is told so.
            if not future.cancel() and future.done() and future.exception() is None:
                return True, future.result()  # it ended just now
            later = "" if future.cancelled() else "; it is under way and will complete"
            response.success, response.message = False, f"not {verb} within query_timeout ({timeout:g} s){later}"
        except Exception as exc:
            response.success, response.message = False, f"not {verb}: {exc}"
        finally:
            with self._lock:
                self.controls_waiting.discard(verb)
        return False, None

    def _on_save_memory(self, request: Trigger.Request, response: Trigger.Response) -> Trigger.Response:
        return self._served(self._save_memory, request, response)

    def _save_memory(self, _request: Trigger.Request, response: Trigger.Response) -> Trigger.Response:
        engine = self.state.engine
        refusal = self._lifecycle_refusal(engine, ask=False)
        if refusal:
            response.success, response.message = False, refusal
            return response
        done, info = self._wait_control(engine.submit_save, response, "saved")
        if not done:
            return response
        response.success = True
        response.message = (f"saved {info.fill} tokens ({info.tokens_seen} seen) to {info.path}: "
                            f"{info.bytes / 1e6:.1f} MB in {info.seconds:.2f} s")
        return response
