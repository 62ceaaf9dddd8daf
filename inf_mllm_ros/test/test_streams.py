"""Several streams on one model (engine/runtime/pool.py, engine/memory/batched_step.py): on tiny random models of every
family, each stream of a pool, its inputs taken with evictions, re-packs, frames and pins and its questions answered in
one batch with the others' (retrieving from its archive), has after every input the memory it would have alone, slot
for slot, and gives the answers it would give alone; the batch's logits are each stream's own step's."""

from __future__ import annotations

import dataclasses
import random
import threading
import time

import pytest
import torch

from inf_mllm_ros.engine.answering import AnswerCancelledError
from inf_mllm_ros.engine.memory.batched_step import BatchedDecoder, DecodeMember
from inf_mllm_ros.engine.memory.decode_step import StaticDecoder
from inf_mllm_ros.engine.models.loading import load_model
from inf_mllm_ros.engine.ops.few_rows import dense, is_packed, prepare_linears, weights_left
from inf_mllm_ros.engine.runtime.pool import Question, StreamPool
from inf_mllm_ros.engine.runtime.pool_engine import PoolEngine
from inf_mllm_ros.engine.runtime.shared_model import SharedModel
from inf_mllm_ros.engine.runtime.stream import KVStream
from inf_mllm_ros.engine.stream_config import StreamConfig
from inf_mllm_ros.testing.random_models import FAMILIES, build_llama, build_model_folder

from test_archive import assert_same_state, cache_state, frame, sentence
from test_ingest_step import assert_same_memory

pytestmark = pytest.mark.usefixtures("one_torch_thread")

ALL_FAMILIES = FAMILIES + ("llama",)
QUESTIONS = ["Where is the pallet?", "What did the forklift do at the dock?", "Which door light changed?",
             "Who moved the crate?"]


@pytest.fixture(scope="module")
def adapters(tmp_path_factory):
    root = tmp_path_factory.mktemp("tiny_models")
    return {family: load_model(build_model_folder(family, root / family, seed=5), device="cpu", dtype="float32")
            for family in ALL_FAMILIES}


def configs() -> dict[str, StreamConfig]:
    """Three memories of one shape (capacity and headroom) that differ in all else: the policy, its bias and pins, the
    archive and its budget, the chunk size."""
    small = dict(capacity=48, headroom=128, archive_size=4096, archive_block=16)
    return {
        "r1": StreamConfig(**small, chunk_size=16, retrieve_tokens=64),
        "r2": StreamConfig(**small, chunk_size=16, retrieve_tokens=32,
                           policy_settings={"attention_bias": 2.0, "pin_share": 0.25}),
        "r3": StreamConfig(**{**small, "archive_size": 0}, chunk_size=8, policy="h2o"),
    }


def script(name: str, seed: int, supports_frames: bool, rounds: int = 3) -> list[list[tuple]]:
    """A stream's inputs, round by round, each ('text', words, stamp, pin) or ('frame', seed, stamp); the seed moves
    the lengths, the pins and where frames fall, so that the streams' fills and positions differ at every question."""
    rng = random.Random(f"{name}-{seed}")
    out = []
    for r in range(rounds):
        items = []
        for k in range(rng.randint(2, 5)):
            stamp = 10.0 * r + k
            items.append(("text", " ".join(sentence(rng.randrange(40)) for _ in range(rng.randint(1, 3))), stamp,
                          rng.random() < 0.2))
            if supports_frames and rng.random() < 0.3:
                items.append(("frame", rng.randrange(1000), stamp + 0.5))
        out.append(items)
    return out


def pool_beside_alone(adapter, seed: int) -> tuple[StreamPool, dict[str, KVStream], dict[str, list[list[tuple]]]]:
    """A pool of the three memories, each memory again alone, and each one's inputs round by round."""
    pool = StreamPool(adapter, configs())
    alone = {name: KVStream(adapter, cfg) for name, cfg in configs().items()}
    return pool, alone, {name: script(name, seed, adapter.supports_frames) for name in pool}


def take(stream: KVStream, item: tuple) -> None:
    if item[0] == "text":
        stream.push_text(item[1], stamp=item[2], pin=item[3])
    else:
        stream.push_frame(frame(item[1]), stamp=item[2])


@pytest.mark.parametrize("seed", [0, pytest.param(1, marks=pytest.mark.slow), pytest.param(2, marks=pytest.mark.slow)])
@pytest.mark.parametrize("family", ALL_FAMILIES)
def test_each_stream_of_a_pool_has_the_memory_and_answers_it_would_have_alone(family, seed, adapters):
    adapter = adapters[family]
    pool, alone, scripts = pool_beside_alone(adapter, seed)
    rng = random.Random(seed)
    retrieved = kept = 0
    for r in range(3):
        for name in pool:
            for item in scripts[name][r]:
                take(pool[name], item)
                take(alone[name], item)
                assert_same_state(cache_state(alone[name]), cache_state(pool[name]))
        questions = {name: Question(rng.choice(QUESTIONS), max_new_tokens=rng.randint(4, 12),
                                    keep_in_memory=rng.random() < 0.4) for name in pool}
        answers = pool.ask_together(questions)
        for name, q in questions.items():
            want = alone[name].ask(q.text, max_new_tokens=q.max_new_tokens, keep_in_memory=q.keep_in_memory)
            got = answers[name]
            assert not isinstance(got, BaseException), got
            assert (got.text, got.tokens_generated, got.retrieved_stamps, got.cut_by_headroom) == (
                want.text, want.tokens_generated, want.retrieved_stamps, want.cut_by_headroom), name
            assert_same_state(cache_state(alone[name]), cache_state(pool[name]))
            retrieved += got.retrieved_tokens > 0
            kept += got.kept_in_memory
    evictions = sum(pool[name].cache.evictions for name in pool)
    assert evictions > 0 and retrieved > 0 and kept > 0  # the memories moved, answers drew on the archives, some stayed
    assert pool.decoder.steps > 0
    assert pool.ingester.batches > 0  # the questions' forwards (inputs went in one by one here)


@pytest.mark.parametrize("family", ALL_FAMILIES)
def test_the_batch_gives_every_member_the_logits_and_tokens_of_its_own_step(family, adapters, monkeypatch):
    """Step by step, each member's logits in the batch are those its stream's own fixed-shape step gives alone (float
    tolerance), and its tokens the same, at fills and positions that differ between the members."""
    adapter = adapters[family]
    pool = StreamPool(adapter, configs())
    for i, name in enumerate(pool):
        for item in [item for r in range(i + 1) for item in script(name, 11, adapter.supports_frames)[r]]:
            take(pool[name], item)
    steps = 6
    opened = {name: pool[name].open_answer(QUESTIONS[i], max_new_tokens=steps) for i, name in enumerate(pool)}
    # Questions of other lengths, other blocks retrieved: each member decodes from a slot and position of its own.
    assert len({(pool[name].cache.fill, pool[name].cache.next_position) for name in pool}) == len(pool)
    alone = {}
    for name in pool:  # each alone over its own storage (slots past the fill, which the batch writes before it reads)
        decoder = StaticDecoder(adapter, pool[name].cache, "static")
        decoder.start(opened[name].logits)
        alone[name] = [(int(decoder.token), decoder.step()[-1].clone()) for _ in range(steps - 1)]
    logits = []
    forward_batch = adapter.forward_batch

    def keeping_logits(*args, **kwargs):
        out = forward_batch(*args, **kwargs)
        logits.append(out.clone())
        return out

    monkeypatch.setattr(adapter, "forward_batch", keeping_logits)
    members = [DecodeMember(pool[name].cache, opened[name].logits, steps, set()) for name in pool]
    BatchedDecoder(adapter).generate(members)
    assert len(logits) == steps - 1
    for row, name in enumerate(pool):
        assert members[row].tokens[:-1] == [token for token, _ in alone[name]], name
        for k, (_, want) in enumerate(alone[name]):
            torch.testing.assert_close(logits[k][row], want, atol=1e-5, rtol=1e-5)
        pool[name].abandon_answer(opened[name])


def test_a_cancelled_answer_leaves_the_batch_and_its_memory_as_it_was_and_the_others_answer_as_alone(adapters):
    adapter = adapters["qwen2_vl"]
    pool = StreamPool(adapter, configs())
    alone = {name: KVStream(adapter, cfg) for name, cfg in configs().items()}
    for name in pool:
        for item in script(name, 3, True)[0]:
            take(pool[name], item)
            take(alone[name], item)
    before = cache_state(pool["r2"])
    cancel = threading.Event()

    def cancel_at_three(text: str, n: int) -> None:
        if n == 3:
            cancel.set()

    answers = pool.ask_together({"r1": Question(QUESTIONS[0], max_new_tokens=10),
                                 "r2": Question(QUESTIONS[1], max_new_tokens=10, on_token=cancel_at_three, cancel=cancel),
                                 "r3": QUESTIONS[2]})
    assert isinstance(answers["r2"], AnswerCancelledError)
    assert_same_state(before, cache_state(pool["r2"]))
    assert answers["r1"].text == alone["r1"].ask(QUESTIONS[0], max_new_tokens=10).text
    assert answers["r3"].text == alone["r3"].ask(QUESTIONS[2]).text
    for name in ("r1", "r3"):
        assert_same_state(cache_state(alone[name]), cache_state(pool[name]))


def test_one_step_serves_every_member_of_the_batch(adapters):
    """The batch takes as many model steps as its longest answer, not the sum of them."""
    adapter = adapters["llama"]
    pool = StreamPool(adapter, configs())
    for name in pool:
        for item in script(name, 4, False)[0]:
            take(pool[name], item)
    answers = pool.ask_together({name: Question(QUESTIONS[0], max_new_tokens=12) for name in pool})
    lengths = [a.tokens_generated for a in answers.values()]
    assert pool.decoder.steps == max(lengths) - 1 < sum(lengths) - len(lengths)


@pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="this torch build has no oneDNN")
def test_linears_are_packed_with_their_weights_unchanged_and_give_torchs_numbers_for_any_rows(adapters):
    """Every CPU float32 linear whose weight no other module shares holds it packed (engine/ops/few_rows.py): the same
    numbers as the checkpoint's, one copy, and for any count of rows (more than 64 padded to a multiple of 64) torch's
    own linear within float tolerance."""
    for family, adapter in adapters.items():
        linears = [m for m in adapter.model.modules() if type(m) is torch.nn.Linear]
        packed = [m for m in linears if is_packed(m)]
        assert packed, family
        reference = dict(type(adapter.model).from_pretrained(adapter.folder, dtype=torch.float32).named_parameters())
        for name, param in adapter.model.named_parameters():
            assert torch.equal(dense(param), reference[name]), (family, name)
        for module in packed:
            weight = dense(module.weight)
            x = torch.randn(130, 1, module.in_features)
            for rows in (1, 2, 4, 8, 9, 64, 65, 130):
                want = torch.nn.functional.linear(x[:rows], weight, module.bias)
                torch.testing.assert_close(module(x[:rows]), want, atol=1e-5, rtol=1e-5)


@pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="this torch build has no oneDNN")
def test_a_shared_wide_weight_takes_a_batchs_few_rows_weights_left_and_else_torchs_own_path():
    """A wide linear whose weight another module shares (a vocabulary projection tied to the embeddings, as the
    default's) stays dense; inside a batch's step 2 to 8 rows go weights-left, within float tolerance of torch's
    linear; one row, many rows and everything outside a batch's step take torch's own path, bit for bit."""
    model, _ = build_llama(None, seed=3)
    model.lm_head.weight = model.model.embed_tokens.weight
    prepare_linears(model)
    prepare_linears(model)  # idempotent
    shared = [m for m in model.modules() if type(m) is torch.nn.Linear and not is_packed(m)]
    assert shared == [model.lm_head] and "forward" in vars(model.lm_head)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    for module in shared:
        for rows in (1, 2, 4, 8, 9):
            x = torch.randn(rows, 1, module.in_features)
            want = torch.nn.functional.linear(x, module.weight, module.bias)
            assert torch.equal(module(x), want)
            with weights_left():
                if rows in (1, 9):
                    assert torch.equal(module(x), want)
                else:
                    torch.testing.assert_close(module(x), want, atol=1e-5, rtol=1e-5)


def test_a_pool_refuses_caches_of_different_shapes_and_a_bad_question_ends_only_its_own_answer(adapters):
    adapter = adapters["llama"]
    with pytest.raises(ValueError, match="one shape"):
        StreamPool(adapter, {"a": StreamConfig(capacity=48, chunk_size=16), "b": StreamConfig(capacity=64, chunk_size=16)})
    pool = StreamPool(adapter, ["a", "b"], StreamConfig(capacity=48, chunk_size=16))
    for name in pool:
        pool[name].push_text(sentence(3), stamp=0.0)
    answers = pool.ask_together({"a": "", "b": QUESTIONS[0]})
    assert isinstance(answers["a"], ValueError) and answers["b"].tokens_generated > 0


def test_a_flooded_stream_leaves_another_streams_question_answered_within_one_round(adapters):
    """A flood of texts into one stream (all of them waiting at once) and a question to another: the question is
    answered in the next round, after at most the one text call in progress, while most of the flood still waits;
    each stream's memory is then what it would be alone with the same inputs in the same order."""
    adapter = adapters["llama"]
    pool = StreamPool(adapter, configs())
    engine = PoolEngine(pool)
    try:
        for name in pool:
            engine.submit_text(name, sentence(1), 0.0).result(timeout=60)
        flood = [engine.submit_text("r1", sentence(i), float(i)) for i in range(200)]
        answer = engine.submit_ask("r2", Question(QUESTIONS[0], max_new_tokens=6)).result(timeout=60)
        taken = sum(f.done() for f in flood)
        assert answer.tokens_generated > 0 and taken < 40  # a text call is bounded by the model's pace (texts wait)
        frame_done = engine.submit_frame("r3", frame(5), 1.0) if adapter.supports_frames else None
        for f in flood:
            f.result(timeout=300)
        if frame_done is not None:
            frame_done.result(timeout=60)
    finally:
        engine.close(timeout=60)
    alone = KVStream(adapter, configs()["r2"])
    alone.push_text(sentence(1), stamp=0.0)
    assert alone.ask(QUESTIONS[0], max_new_tokens=6).text == answer.text
    assert_same_state(cache_state(alone), cache_state(pool["r2"]))


def test_memories_on_a_shared_model_load_it_once_take_turns_and_keep_what_they_would_alone(adapters):
    """Two engines built through one SharedModel (the node's `streams`): the model is loaded once for both; a flood of
    texts into one leaves the other's question answered after at most the job in progress, while most of the flood
    still waits; and each memory is what it would be alone."""
    folder = adapters["llama"].folder
    shared = SharedModel()
    options = dict(device="cpu", dtype="float32", max_pending_texts=500)
    flooded, asked = shared.engine(folder, configs()["r1"], **options), shared.engine(folder, configs()["r2"], **options)
    try:
        assert flooded.wait_ready(120) and asked.wait_ready(120)
        assert shared.loads == 1 and flooded.adapter is asked.adapter
        flooded.push_text(sentence(1), 0.0, timeout=60)
        asked.push_text(sentence(2), 0.0, timeout=60)
        flood = [flooded.submit_text(sentence(i), float(i)) for i in range(200)]
        answer = asked.submit_ask(QUESTIONS[0], max_new_tokens=6).result(timeout=60)
        taken = sum(f.done() for f in flood)
        assert answer.tokens_generated > 0 and taken < 40, taken
        for f in flood:
            f.result(timeout=300)
        with pytest.raises(ValueError, match="loaded once"):
            shared.engine(folder, configs()["r3"], device="cpu", dtype="bfloat16")
    finally:
        flooded.close(timeout=60)
        asked.close(timeout=60)
    alone = KVStream(adapters["llama"], configs()["r2"])
    alone.push_text(sentence(2), stamp=0.0)
    assert alone.ask(QUESTIONS[0], max_new_tokens=6).text == answer.text
    alone_flooded = KVStream(adapters["llama"], configs()["r1"])
    alone_flooded.push_text(sentence(1), stamp=0.0)
    alone_flooded.push_texts([(sentence(i), float(i)) for i in range(200)])
    assert alone_flooded.tokens_seen == flooded.stats().tokens_seen


def test_questions_that_wait_at_once_are_answered_in_one_batch(adapters):
    adapter = adapters["llama"]
    pool = StreamPool(adapter, configs())
    for name in pool:
        pool[name].push_text(sentence(2), stamp=0.0)
    engine = PoolEngine(pool)
    try:
        with engine.lock:  # every question waits before the worker takes any
            futures = {name: engine.submit_ask(name, Question(QUESTIONS[1], max_new_tokens=8)) for name in pool}
        answers = {name: f.result(timeout=60) for name, f in futures.items()}
    finally:
        engine.close(timeout=60)
    assert engine.rounds == 1
    assert pool.decoder.steps == max(a.tokens_generated for a in answers.values()) - 1


@pytest.mark.parametrize("family", ["llama", "qwen2_vl"])
def test_inputs_that_wait_at_once_go_in_batched_and_leave_each_memory_as_alone(family, adapters):
    """Texts, then frames, waiting in every stream of a pool engine before its worker takes any: each kind goes in as
    one batch a block, and each memory is what it would be alone."""
    adapter = adapters[family]
    pool = StreamPool(adapter, configs())
    alone = {name: KVStream(adapter, cfg) for name, cfg in configs().items()}
    engine = PoolEngine(pool)
    try:
        for k, name in enumerate(pool):  # the system turns: a memory's first input goes in alone
            engine.submit_text(name, sentence(k), 0.0).result(timeout=60)
            alone[name].push_text(sentence(k), stamp=0.0)
        batches = pool.ingester.batches
        with engine.lock:
            futures = {name: engine.submit_text(name, " ".join(sentence(k + i) for i in range(k + 1)), 1.0)
                       for k, name in enumerate(pool)}
        counts = {name: f.result(timeout=60) for name, f in futures.items()}
        assert pool.ingester.batches > batches
        if adapter.supports_frames:
            batches = pool.ingester.batches
            with engine.lock:
                futures.update({f"{name} frame": engine.submit_frame(name, frame(k), 2.0) for k, name in enumerate(pool)})
            counts.update({name: f.result(timeout=60) for name, f in futures.items()})
            assert pool.ingester.batches > batches
    finally:
        engine.close(timeout=60)
    for k, name in enumerate(pool):
        assert counts[name] == alone[name].push_text(" ".join(sentence(k + i) for i in range(k + 1)), stamp=1.0)
        if adapter.supports_frames:
            assert counts[f"{name} frame"] == alone[name].push_frame(frame(k), stamp=2.0)
        assert_same_memory(cache_state(alone[name]), cache_state(pool[name]))


@pytest.mark.parametrize("family, seed, sizes", [("llama", 0, "one"), ("qwen2_vl", 1, "one"),
                                                 ("llava_onevision", 2, "one"), ("llama", 3, "two")])
def test_questions_of_memories_on_a_shared_model_that_wait_at_once_decode_in_one_batch(adapters, family, seed, sizes):
    """Three engines through one SharedModel (the node's `streams`), each told its own texts (and frames). Their
    questions come while the model is held, so all wait at once: the answers are taken off the bench together, one a
    kept answer, and each is the answer its memory gives alone, each memory then what it would be alone. Where one
    memory's cache is of another size (the node's `<name>.cache_size`), the answers of each size decode as a batch of
    their own. A question that waits alone afterwards is answered on its stream's own step."""
    adapter = adapters[family]
    shared = SharedModel()
    made = configs()
    if sizes == "two":
        made["r3"] = dataclasses.replace(made["r3"], capacity=64)
    engines = {name: shared.engine(adapter.folder, cfg, device="cpu", dtype="float32") for name, cfg in made.items()}
    alone = {name: KVStream(adapter, cfg) for name, cfg in made.items()}
    kept = {"r1": False, "r2": True, "r3": False}
    try:
        assert all(engine.wait_ready(120) for engine in engines.values())
        for name, engine in engines.items():
            for items in script(name, seed, adapter.supports_frames, rounds=2):
                for item in items:
                    if item[0] == "text":
                        engine.push_text(item[1], item[2], pin=item[3], timeout=60)
                        alone[name].push_text(item[1], stamp=item[2], pin=item[3])
                    else:
                        engine.push_frame(frame(item[1]), item[2], timeout=60)
                        alone[name].push_frame(frame(item[1]), item[2])
        with shared.turns.turn():  # the model held: every question waits before any is taken
            futures = {name: engine.submit_ask(QUESTIONS[i], max_new_tokens=8, keep_in_memory=kept[name])
                       for i, (name, engine) in enumerate(engines.items())}
            deadline = time.monotonic() + 30
            while shared.turns.asked < 1 + len(engines) and time.monotonic() < deadline:
                time.sleep(0.01)
            assert shared.turns.asked == 1 + len(engines)  # every worker waits for the model with its question
        answers = {name: f.result(timeout=120) for name, f in futures.items()}
        assert shared.bench.batch_sizes == {3: 1}
        later = engines["r1"].ask(QUESTIONS[3], max_new_tokens=6, timeout=60)
        assert shared.bench.batch_sizes == {3: 1}
        for i, name in enumerate(engines):
            want = alone[name].ask(QUESTIONS[i], max_new_tokens=8, keep_in_memory=kept[name])
            assert answers[name].text == want.text and answers[name].tokens_generated == want.tokens_generated
            assert [e.first_seq for e in answers[name].evidence] == [e.first_seq for e in want.evidence]
        assert later.text == alone["r1"].ask(QUESTIONS[3], max_new_tokens=6).text
        for name, engine in engines.items():
            assert_same_state(cache_state(alone[name]), cache_state(engine.worker.stream))
    finally:
        for engine in engines.values():
            engine.close(timeout=60)


@pytest.mark.parametrize("family", ["llama", "qwen2_vl"])
def test_inputs_of_memories_on_a_shared_model_that_wait_at_once_go_in_batched_and_as_alone(family, adapters):
    """Texts, then frames, for three engines through one SharedModel, all waiting while the model is held: they go
    through the model off the bench together, a batch a block, and each memory is what it would be alone."""
    adapter = adapters[family]
    shared = SharedModel()
    engines = {name: shared.engine(adapter.folder, cfg, device="cpu", dtype="float32")
               for name, cfg in configs().items()}
    alone = {name: KVStream(adapter, cfg) for name, cfg in configs().items()}
    inputs = {"text": lambda k: (" ".join(sentence(k + i) for i in range(k + 1)), 1.0)}
    if adapter.supports_frames:
        inputs["frame"] = lambda k: (frame(k), 2.0)
    counts = {}
    try:
        assert all(engine.wait_ready(120) for engine in engines.values())
        for k, (name, engine) in enumerate(engines.items()):  # a memory's first input (its system turn) goes alone
            engine.push_text(sentence(k), 0.0, timeout=60)
            alone[name].push_text(sentence(k), stamp=0.0)
        for kind, given in inputs.items():
            batches = shared.bench.forward_batches
            with shared.turns.turn():  # the model held: every input waits before any is taken
                futures = {name: (engine.submit_text if kind == "text" else engine.submit_frame)(*given(k))
                           for k, (name, engine) in enumerate(engines.items())}
                deadline = time.monotonic() + 30
                while shared.turns.asked < 1 + len(engines) and time.monotonic() < deadline:
                    time.sleep(0.01)
            counts[kind] = {name: f.result(timeout=120) for name, f in futures.items()}
            assert shared.bench.forward_batches > batches, kind
    finally:
        for engine in engines.values():
            engine.close(timeout=60)
    for k, (name, engine) in enumerate(engines.items()):
        for kind, given in inputs.items():
            push = alone[name].push_text if kind == "text" else alone[name].push_frame
            assert counts[kind][name] == push(*given(k)), (kind, name)
        assert_same_memory(cache_state(alone[name]), cache_state(engine.worker.stream))


def waves(scripts: dict[str, list[tuple]]):
    """The streams' inputs of a round given at once, k-th with k-th: each wave's texts together, then its frames."""
    for k in range(max(len(items) for items in scripts.values())):
        wave = {name: items[k] for name, items in scripts.items() if k < len(items)}
        texts = {name: [(item[1], item[2], item[3])] for name, item in wave.items() if item[0] == "text"}
        frames = {name: (frame(item[1]), item[2]) for name, item in wave.items() if item[0] == "frame"}
        yield texts, frames


@pytest.mark.parametrize("seed", [0, pytest.param(1, marks=pytest.mark.slow), 2])
@pytest.mark.parametrize("family", ALL_FAMILIES)
def test_inputs_given_at_once_go_in_as_batches_and_leave_each_memory_as_alone(family, seed, adapters):
    adapter = adapters[family]
    pool, alone, scripts = pool_beside_alone(adapter, seed)
    rng = random.Random(seed)
    for r in range(3):
        for texts, frames in waves({name: scripts[name][r] for name in pool}):
            for together, push in ((texts, pool.push_texts_together), (frames, pool.push_frames_together)):
                if not together:
                    continue
                got = push(together)
                for name, given in together.items():
                    want = (alone[name].push_texts(given) if push == pool.push_texts_together
                            else alone[name].push_frame(*given))
                    assert got[name] == want, name
                    assert_same_memory(cache_state(alone[name]), cache_state(pool[name]))
        for name in pool:
            q = rng.choice(QUESTIONS)
            got, want = pool[name].ask(q, max_new_tokens=8), alone[name].ask(q, max_new_tokens=8)
            assert (got.text, got.retrieved_stamps) == (want.text, want.retrieved_stamps), name
    assert pool.ingester.batches > 0 and pool.ingester.blocks > 2 * pool.ingester.batches - 1
    assert sum(pool[name].cache.evictions for name in pool) > 0
