"""Models by hub id: `Org/Name` (with a branch, tag or commit) resolved to a folder through `huggingface_hub`.

The local hub cache comes first, laid out as the library lays it out (`models--Org--Name/` with `blobs/`,
`snapshots/<commit>/` whose files link to the blobs, and `refs/<branch or tag>` holding a commit), and no network
is touched when the snapshot there is complete. Otherwise the files a model needs are downloaded (its config,
the safetensors weights or else the .bin ones, the tokenizer, processor and chat template files; its `*.py` only
with `trust_remote_code`), with the bytes done and the total reported as they come. `HF_HOME`, `HF_HUB_CACHE` and
`HF_HUB_OFFLINE` are read at each call (the library reads them once, when it is imported). Offline, or with the
hub out of reach, and not cached: `ModelUnavailableError` in one line that names the model, the cache folder
searched and the command that fetches it where there is network.

Free of ROS and of torch; loading.py calls it for a model name that is no folder and no embedded model.
"""

from __future__ import annotations

import fnmatch
import json
import logging
import os
import re
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Protocol

from ..model_errors import ModelLoadError, ModelUnavailableError

log = logging.getLogger(__name__)

Progress = Callable[[int, int], None]  # (bytes done, bytes in all) of a download
PROGRESS_PERIOD = 0.5  # seconds between progress reports while a download runs

# Hub repository names: a namespace and a name of letters, digits, '-', '_' and '.', neither starting nor ending
# with '-' or '.', no '--' or '..' (the hub's own rule), 96 characters at most.
_PART = r"[A-Za-z0-9](?:[A-Za-z0-9_.\-]*[A-Za-z0-9_])?"
_REPO_ID = re.compile(rf"^{_PART}/{_PART}$")
_COMMIT = re.compile(r"^[0-9a-f]{40}$")
_TRUE = {"1", "on", "yes", "true"}

# What a model needs beside its weights: config, generation config, tokenizer (json, merges, sentencepiece,
# tiktoken), processor and chat template files, at the top of the repository.
_SIDE_FILES = ("*.json", "*.txt", "*.model", "*.jinja", "*.tiktoken")
_SAFETENSORS = ("model*.safetensors", "*.safetensors")  # the first that matches anything (consolidated.* aside)
_BIN = ("pytorch_model*.bin",)


def is_hub_id(model: str | os.PathLike | None) -> bool:
    """Whether `model` reads as a hub id (`Org/Name`) and names no path that exists (an existing path is always a
    folder, even one named like an id)."""
    if model is None:
        return False
    text = str(model)
    if len(text) > 96 or "--" in text or ".." in text or not _REPO_ID.match(text):
        return False
    return not Path(text).expanduser().exists()


def hub_cache_dir() -> Path:
    """The hub cache folder, from the environment now: HF_HUB_CACHE, else $HF_HOME/hub, else
    $XDG_CACHE_HOME/huggingface/hub, else ~/.cache/huggingface/hub."""
    env = os.environ
    cache = env.get("HF_HUB_CACHE") or env.get("HUGGINGFACE_HUB_CACHE")
    if cache:
        return Path(cache).expanduser()
    home = env.get("HF_HOME") or os.path.join(env.get("XDG_CACHE_HOME") or "~/.cache", "huggingface")
    return Path(home).expanduser() / "hub"


def hub_offline() -> bool:
    """HF_HUB_OFFLINE, read now."""
    return os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in _TRUE


def repo_folder(cache: Path, repo_id: str) -> Path:
    """Where the cache keeps a model repository."""
    return cache / ("models--" + repo_id.replace("/", "--"))


def download_command(repo_id: str, revision: str = "") -> str:
    """The command that fetches the model into the hub cache (`hf download`; `huggingface-cli download` before
    huggingface_hub 0.34, which brought the `hf` command)."""
    tool = "hf"
    try:
        import huggingface_hub

        major, minor = (int(x) for x in re.findall(r"\d+", huggingface_hub.__version__)[:2])
        if (major, minor) < (0, 34):
            tool = "huggingface-cli"
    except (ImportError, ValueError):
        pass
    return f"{tool} download {repo_id}" + (f" --revision {revision}" if revision else "")


def _named(repo_id: str, revision: str) -> str:
    return f"model {repo_id!r}" + (f" (revision {revision!r})" if revision else "")


def weights_missing(folder: Path) -> str:
    """What the folder lacks to be loaded ('' when nothing): its config, or its weights (every shard an index
    names)."""
    if not (folder / "config.json").is_file():
        return "config.json"
    for index in ("model.safetensors.index.json", "pytorch_model.bin.index.json"):
        if (folder / index).is_file():
            try:
                shards = set(json.loads((folder / index).read_text())["weight_map"].values())
            except (ValueError, KeyError, OSError, AttributeError):
                return f"a readable {index}"
            missing = sorted(s for s in shards if not (folder / s).is_file())
            return f"{len(missing)} weight files ({', '.join(missing[:3])})" if missing else ""
    if any(p.is_file() for pattern in ("*.safetensors", "*.bin") for p in folder.glob(pattern)):
        return ""
    return "weights (*.safetensors or *.bin)"


def cached_snapshot(repo_id: str, revision: str = "", cache: Path | None = None) -> Path | None:
    """The cached snapshot folder of the model at `revision` (a branch or tag through refs/, or a commit; empty:
    main), whether complete or not; None when the cache has none. Touches no network."""
    from huggingface_hub import try_to_load_from_cache

    cache = hub_cache_dir() if cache is None else cache
    found = try_to_load_from_cache(repo_id, "config.json", cache_dir=str(cache), revision=revision or None)
    if isinstance(found, str):
        return Path(found).parent
    # No config.json there: a snapshot may still exist (an interrupted download), to say so.
    storage = repo_folder(cache, repo_id)
    commit = revision if _COMMIT.match(revision or "") else None
    if commit is None:
        ref = storage / "refs" / (revision or "main")
        commit = ref.read_text().strip() if ref.is_file() else None
    snapshot = storage / "snapshots" / commit if commit else None
    return snapshot if snapshot is not None and snapshot.is_dir() else None


def files_to_fetch(names: list[str], *, trust_remote_code: bool = False) -> list[str]:
    """Of a repository's files, those the model needs: the top-level config, tokenizer, processor and chat
    template files, the safetensors weights or else the .bin ones, and `*.py` only with `trust_remote_code`."""
    top = sorted(n for n in names if "/" not in n)
    weights: list[str] = []
    for pattern in _SAFETENSORS:
        weights = [n for n in top if fnmatch.fnmatch(n, pattern)]
        if weights:
            break
    side = [n for n in top if any(fnmatch.fnmatch(n, p) for p in _SIDE_FILES)]
    if weights:  # the .bin index is not wanted beside safetensors
        side = [n for n in side if not n.endswith(".bin.index.json")]
    else:
        weights = [n for n in top if any(fnmatch.fnmatch(n, p) for p in _BIN)]
        side = [n for n in side if not n.endswith(".safetensors.index.json")]
    code = [n for n in top if n.endswith(".py")] if trust_remote_code else []
    return sorted(set(side + weights + code))


@dataclass(frozen=True)
class RemoteFiles:
    """A repository at one commit, as the hub lists it: its files and their sizes in bytes."""

    commit: str
    sizes: dict[str, int]


class HubSource(Protocol):
    """Where a model that is not cached comes from (the hub itself; tests pass a stand-in)."""

    def list_files(self, repo_id: str, revision: str) -> RemoteFiles: ...

    def download(self, repo_id: str, revision: str, files: list[str], cache: Path) -> Path:
        """Fetch `files` into the hub cache `cache`; the snapshot folder."""
        ...


class Hub:
    """The hub through huggingface_hub (its token, endpoint and proxies as the library reads them)."""

    def list_files(self, repo_id: str, revision: str) -> RemoteFiles:
        from huggingface_hub import HfApi

        info = HfApi().model_info(repo_id, revision=revision or None, files_metadata=True)
        return RemoteFiles(info.sha or "", {s.rfilename: int(s.size or 0) for s in info.siblings or ()})

    def download(self, repo_id: str, revision: str, files: list[str], cache: Path) -> Path:
        from huggingface_hub import snapshot_download

        # Exact names as the patterns: only these files, and refs/<revision> written as the library does.
        return Path(snapshot_download(repo_id, revision=revision or None, cache_dir=str(cache),
                                      allow_patterns=[_literal(f) for f in files]))


def _literal(name: str) -> str:
    """A file name as an fnmatch pattern that matches only it."""
    return re.sub(r"([*?\[])", r"[\1]", name)


def _blob_bytes(storage: Path) -> int:
    """Bytes in a repository's blobs folder, downloads in progress (*.incomplete) included."""
    total = 0
    try:
        with os.scandir(storage / "blobs") as entries:
            for entry in entries:
                try:
                    total += entry.stat(follow_symlinks=False).st_size
                except OSError:
                    pass
    except OSError:
        pass
    return total


def _watch(storage: Path, start: int, total: int, progress: Progress, stop: threading.Event) -> None:
    while not stop.wait(PROGRESS_PERIOD):
        progress(min(max(_blob_bytes(storage) - start, 0), total), total)


def resolve_hub_model(repo_id: str, revision: str = "", *, trust_remote_code: bool = False,
                      progress: Progress | None = None, source: HubSource | None = None) -> Path:
    """The local folder of the hub model `repo_id` at `revision` (empty: main): the cached snapshot when it is
    complete, downloaded otherwise (unless offline), with `progress(done, total)` in bytes as the download goes
    (from another thread, every PROGRESS_PERIOD seconds, and once at the end)."""
    cache, revision = hub_cache_dir(), (revision or "").strip()
    named, command = _named(repo_id, revision), download_command(repo_id, revision)
    cached = cached_snapshot(repo_id, revision, cache)
    lacking = weights_missing(cached) if cached is not None else "everything"
    if cached is not None and not lacking:
        log.info("%s found in the hub cache: %s", named, cached)
        return cached
    where = f"in the hub cache {cache}" if cached is None else f"complete in the hub cache {cache} (it lacks {lacking})"
    if hub_offline():
        raise ModelUnavailableError(f"{named} is not a folder and not {where}, and HF_HUB_OFFLINE is set: "
                                    f"run `{command}` where there is network (into this cache folder, or copy it "
                                    f"here)")
    source = source or Hub()
    try:
        remote = source.list_files(repo_id, revision)
    except Exception as exc:
        raise _hub_error(exc, named, where, command) from exc
    files = files_to_fetch(list(remote.sizes), trust_remote_code=trust_remote_code)
    if "config.json" not in files:
        raise ModelLoadError(f"{named} on the hub has no config.json (not a transformers model)")
    have = repo_folder(cache, repo_id) / "snapshots" / remote.commit
    total = sum(remote.sizes[f] for f in files if not (have / f).is_file())
    log.info("%s: downloading %d files, %.1f MB, into %s", named, len(files), total / 1e6, cache)
    stop = threading.Event()
    watcher = None
    if progress is not None:
        progress(0, total)
        storage = repo_folder(cache, repo_id)
        watcher = threading.Thread(target=_watch, args=(storage, _blob_bytes(storage), total, progress, stop),
                                   name="hub-download-progress", daemon=True)
        watcher.start()
    try:
        folder = source.download(repo_id, revision, files, cache)
    except Exception as exc:
        raise _hub_error(exc, named, where, command) from exc
    finally:
        stop.set()
        if watcher is not None:
            watcher.join()
    if progress is not None:
        progress(total, total)
    lacking = weights_missing(folder)
    if lacking:
        raise ModelLoadError(f"{named}: the downloaded snapshot {folder} lacks {lacking}")
    return folder


def _hub_error(exc: Exception, named: str, where: str, command: str) -> ModelLoadError:
    """One line for a hub look-up or download that failed."""
    kind = type(exc).__name__
    first = (str(exc).strip().splitlines() or [""])[0]
    if kind in ("RepositoryNotFoundError", "GatedRepoError"):
        return ModelLoadError(f"{named} is not a folder and the hub has no such model, or it is private or gated "
                              f"(log in with `hf auth login` or set HF_TOKEN): {first}")
    if kind == "RevisionNotFoundError":
        return ModelLoadError(f"{named}: the hub has no such revision (a branch, tag or commit): {first}")
    return ModelUnavailableError(f"{named} is not a folder and not {where}, and the hub could not be reached "
                                 f"({kind}: {first}): run `{command}` where there is network (into this cache "
                                 f"folder, or copy it here)")
