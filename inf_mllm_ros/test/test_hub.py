"""Models by hub id (engine/models/hub.py): a local hub cache laid out as huggingface_hub lays it out, holding a
tiny random model made here, resolved by name, tag and commit with HF_HUB_OFFLINE=1; an uncached id fails offline
in one clear line; and the installed node, configured with `model:=Org/Name` against that cache, becomes ready or
says why not. No download is made here (no network): the progress of one is checked with a stand-in source that
writes the bytes into the cache as the library does."""

from __future__ import annotations

import hashlib
import os
import shutil
import signal
import time
from pathlib import Path

import pytest

from inf_mllm_ros.engine.model_errors import ModelLoadError, ModelUnavailableError
from inf_mllm_ros.engine.models import hub
from inf_mllm_ros.engine.models.hub import RemoteFiles, files_to_fetch, is_hub_id, resolve_hub_model
from inf_mllm_ros.engine.models.loading import fetch_model, resolve_model
from inf_mllm_ros.testing.random_models import build_model_folder

REPO = "TinyOrg/Tiny-LM.v1"
OLD, NEW = "a" * 40, "0123456789abcdef0123456789abcdef01234567"  # the tag's commit, main's commit
TAG = "v1.0"


def blob_name(data: bytes, lfs: bool) -> str:
    """As the hub names blobs: the sha256 of an LFS file, the git blob sha1 of any other."""
    if lfs:
        return hashlib.sha256(data).hexdigest()
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def add_snapshot(cache: Path, repo_id: str, commit: str, source: Path, refs: tuple[str, ...] = ()) -> Path:
    """Put the files of `source` into the hub cache as commit `commit` (blobs, snapshot links, refs)."""
    storage = cache / ("models--" + repo_id.replace("/", "--"))
    blobs, snapshot = storage / "blobs", storage / "snapshots" / commit
    blobs.mkdir(parents=True, exist_ok=True)
    snapshot.mkdir(parents=True, exist_ok=True)
    for f in sorted(source.iterdir()):
        data = f.read_bytes()
        name = blob_name(data, f.suffix == ".safetensors")
        if not (blobs / name).exists():
            (blobs / name).write_bytes(data)
        (snapshot / f.name).symlink_to(Path("..") / ".." / "blobs" / name)
    for ref in refs:
        (storage / "refs").mkdir(exist_ok=True)
        (storage / "refs" / ref).write_text(commit)  # the library writes the commit without a newline
    return snapshot


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory) -> Path:
    return build_model_folder("llama", tmp_path_factory.mktemp("tiny") / "llama")


@pytest.fixture
def hub_cache(tmp_path, tiny_model, monkeypatch) -> Path:
    """A hub cache in tmp_path holding REPO at two commits: main at NEW, the tag v1.0 at OLD; offline."""
    cache = tmp_path / "hub"
    add_snapshot(cache, REPO, OLD, tiny_model, refs=(TAG,))
    add_snapshot(cache, REPO, NEW, tiny_model, refs=("main",))
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    return cache


def test_hub_ids_are_told_from_folders_and_embedded_names(tmp_path, monkeypatch):
    assert is_hub_id("Qwen/Qwen2-VL-2B-Instruct") and is_hub_id(REPO)
    for other in ("smolvlm-smollm2", "onevision-qwen2.5-0.5b", "/models/Qwen2-VL", "./a/b", "~/a/b", "a/b/c",
                  "a--b/c", "a/.b", "-a/b", "", None):
        assert not is_hub_id(other), other
    # A folder that exists is a folder, even one named like an id.
    monkeypatch.chdir(tmp_path)
    (tmp_path / "Org" / "Name").mkdir(parents=True)
    assert not is_hub_id("Org/Name") and fetch_model("Org/Name") == "Org/Name"


def test_resolved_offline_from_the_cache_by_name_tag_and_commit(hub_cache):
    storage = hub_cache / ("models--" + REPO.replace("/", "--"))
    assert resolve_hub_model(REPO) == storage / "snapshots" / NEW
    assert resolve_hub_model(REPO, "main") == storage / "snapshots" / NEW
    assert resolve_hub_model(REPO, TAG) == storage / "snapshots" / OLD
    assert resolve_hub_model(REPO, OLD) == storage / "snapshots" / OLD
    # Through loading.py, checked as any model folder is.
    folder = resolve_model(REPO, TAG)
    assert folder == storage / "snapshots" / OLD and (folder / "config.json").is_file()


def test_hf_home_is_read_at_call_time(tmp_path, tiny_model, monkeypatch):
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    monkeypatch.delenv("HUGGINGFACE_HUB_CACHE", raising=False)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "home"))
    snapshot = add_snapshot(tmp_path / "home" / "hub", REPO, NEW, tiny_model, refs=("main",))
    assert hub.hub_cache_dir() == tmp_path / "home" / "hub"
    assert resolve_hub_model(REPO) == snapshot


def test_an_uncached_id_fails_offline_in_one_clear_line(hub_cache):
    for model, revision, command in (("NoOrg/No-Model", "", "hf download NoOrg/No-Model"),
                                     (REPO, "v9", f"hf download {REPO} --revision v9")):
        with pytest.raises(ModelUnavailableError) as caught:
            fetch_model(model, revision)
        message = str(caught.value)
        assert "\n" not in message and repr(model) in message, message
        assert str(hub_cache) in message and "HF_HUB_OFFLINE" in message and f"`{command}`" in message, message


def test_an_incomplete_cached_snapshot_is_not_taken(hub_cache):
    storage = hub_cache / ("models--" + REPO.replace("/", "--"))
    (storage / "snapshots" / NEW / "model.safetensors").unlink()  # a download cut short
    with pytest.raises(ModelUnavailableError, match=r"lacks weights .* HF_HUB_OFFLINE is set"):
        resolve_hub_model(REPO)


def test_only_the_files_a_model_needs_are_fetched():
    names = ["config.json", "generation_config.json", "model-00001-of-00002.safetensors",
             "model-00002-of-00002.safetensors", "model.safetensors.index.json", "pytorch_model.bin",
             "pytorch_model.bin.index.json", "consolidated.safetensors", "tokenizer.json", "tokenizer_config.json",
             "merges.txt", "vocab.json", "preprocessor_config.json", "chat_template.jinja", "README.md",
             ".gitattributes", "modeling_custom.py", "onnx/model.onnx", "original/params.json", "training_args.bin"]
    fetched = files_to_fetch(names)
    assert fetched == ["chat_template.jinja", "config.json", "generation_config.json",
                       "merges.txt", "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors",
                       "model.safetensors.index.json", "preprocessor_config.json", "tokenizer.json",
                       "tokenizer_config.json", "vocab.json"]
    assert "modeling_custom.py" in files_to_fetch(names, trust_remote_code=True)
    no_safetensors = [n for n in names if not n.endswith(".safetensors")]
    weights = [n for n in files_to_fetch(no_safetensors) if "model" in n and not n.endswith(".py")]
    assert weights == ["pytorch_model.bin", "pytorch_model.bin.index.json"]


class WritingSource:
    """A stand-in for the hub: lists the tiny model's files, and "downloads" them by writing their bytes in
    pieces into blobs/<name>.incomplete (as the library does), then moving them in place and linking the
    snapshot; no network."""

    def __init__(self, model: Path, chunk: int = 64 * 1024, pause: float = 0.01):
        self.model, self.chunk, self.pause = model, chunk, pause
        self.sizes = {f.name: f.stat().st_size for f in model.iterdir()}
        self.sizes.update({"README.md": 10_000_000, "onnx/model.onnx": 10_000_000})  # not to be fetched

    def list_files(self, repo_id: str, revision: str) -> RemoteFiles:
        return RemoteFiles(NEW, self.sizes)

    def download(self, repo_id: str, revision: str, files: list[str], cache: Path) -> Path:
        storage = cache / ("models--" + repo_id.replace("/", "--"))
        (storage / "blobs").mkdir(parents=True, exist_ok=True)
        snapshot = storage / "snapshots" / NEW
        snapshot.mkdir(parents=True, exist_ok=True)
        for name in files:
            data = (self.model / name).read_bytes()
            blob = storage / "blobs" / blob_name(data, name.endswith(".safetensors"))
            part = blob.with_name(blob.name + ".incomplete")
            with open(part, "wb") as out:
                for start in range(0, len(data), self.chunk):
                    out.write(data[start:start + self.chunk])
                    out.flush()
                    time.sleep(self.pause)
            part.rename(blob)
            (snapshot / name).symlink_to(Path("..") / ".." / "blobs" / blob.name)
        (storage / "refs").mkdir(exist_ok=True)
        (storage / "refs" / (revision or "main")).write_text(NEW)
        return snapshot


def test_a_download_reports_its_bytes_done_and_total(tmp_path, tiny_model, monkeypatch):
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setattr(hub, "PROGRESS_PERIOD", 0.01)
    reports: list[tuple[int, int]] = []
    source = WritingSource(tiny_model)
    folder = resolve_hub_model("Other/Tiny", progress=lambda done, total: reports.append((done, total)),
                               source=source)
    total = sum(f.stat().st_size for f in tiny_model.iterdir())
    assert folder == tmp_path / "hub" / "models--Other--Tiny" / "snapshots" / NEW
    assert reports[0] == (0, total) and reports[-1] == (total, total)
    dones = [d for d, t in reports]
    assert dones == sorted(dones) and len({d for d in dones if 0 < d < total}) >= 2, reports
    # Now cached: found again without the source, offline.
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert resolve_hub_model("Other/Tiny") == folder


def test_an_unreachable_hub_and_an_unknown_model_say_so(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)

    class Unreachable:
        def __init__(self, error: Exception):
            self.error = error

        def list_files(self, repo_id, revision):
            raise self.error

    with pytest.raises(ModelUnavailableError, match=r"could not be reached \(ConnectError: no route\).*`hf download"):
        resolve_hub_model("Org/Name", source=Unreachable(type("ConnectError", (OSError,), {})("no route")))
    not_found = type("RepositoryNotFoundError", (Exception,), {})("404 Client Error")
    with pytest.raises(ModelLoadError, match="no such model, or it is private or gated"):
        resolve_hub_model("Org/Name", source=Unreachable(not_found))


# --- across processes: the installed node -------------------------------------------------------------------------
NODE_PARAMS = {"cache_size": 128, "archive_size": 0, "max_new_tokens": 4, "description_period": 0.0,
               "stats_period": 0.0, "torch_threads": 1}


def run_node(tmp_path: Path, cache: Path, params: dict, name: str):
    from inf_mllm_ros.testing.node_process import NodeProcess

    folder = tmp_path / name
    folder.mkdir()
    env = {"HF_HUB_CACHE": str(cache), "HF_HUB_OFFLINE": "1"}
    return NodeProcess(int(os.environ["ROS_DOMAIN_ID"]), dict(NODE_PARAMS, **params), folder, extra_env=env,
                       namespace=f"/hub_{name}")


def wait_for(process, text: str, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if text in process.log():
            return True
        if not process.alive:
            return text in process.log()
        time.sleep(0.2)
    return False


def test_the_node_configures_from_the_hub_cache_offline_or_says_why_not(hub_cache, tmp_path):
    ready = run_node(tmp_path, hub_cache, {"model": REPO, "model_revision": TAG}, "cached")
    missing = run_node(tmp_path, hub_cache, {"model": "NoOrg/No-Model"}, "uncached")
    try:
        assert wait_for(ready, "active: taking camera frames and texts", 180), ready.log()[-3000:]
        log = ready.log()
        assert str(hub_cache / "models--TinyOrg--Tiny-LM.v1" / "snapshots" / OLD) in log, log[-3000:]
        assert missing.proc.wait(180) == 1, missing.log()[-3000:]
        errors = [line for line in missing.log().splitlines() if line.startswith("[ERROR]")]
        assert len(errors) == 1, missing.log()[-3000:]
        assert "'NoOrg/No-Model'" in errors[0] and str(hub_cache) in errors[0], errors
        assert "`hf download NoOrg/No-Model`" in errors[0], errors
    finally:
        missing.stop()
        ready.proc.send_signal(signal.SIGINT)
        code, _, killed = ready.stop()
    assert code == 0 and not killed, ready.log()[-3000:]
    shutil.rmtree(tmp_path / "cached", ignore_errors=True)
