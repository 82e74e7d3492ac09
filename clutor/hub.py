"""Models from the Hugging Face Hub: ``REPO[:QUANT]`` resolved to GGUF files in the Hub's own cache.

A name is resolved as llama.cpp's ``-hf`` resolves it: ``QUANT`` is a tag in the file name
(``Q4_K_M`` matches ``Model-Q4_K_M.gguf`` and ``Q4_K_M/Model-Q4_K_M-00001-of-00003.gguf``, not
``Model-IQ4_K_M.gguf``), no tag means Q4_K_M, else Q8_0, else the repo's first model file; a split
set (``-00001-of-0000N.gguf``) resolves to all of its parts; projector and imatrix files are never
models. ``QUANT`` may also be a file's path in the repo (``REPO:sub/dir/file.gguf``).

Files land in huggingface_hub's standard cache (``HF_HUB_CACHE``, else ``HF_HOME/hub``, else
``~/.cache/huggingface/hub``) through huggingface_hub itself, so ``hf cache`` and every other Hub
tool see them; ``HF_TOKEN`` and ``HF_ENDPOINT`` work as they do there. A plain HTTP download
resumes across runs: it is written to ``blobs/ETAG.incomplete`` (the cache's name for a partial
blob) and continued with a Range request, which huggingface_hub alone (2.x) does not do after an
interrupted process. Everything here is blocking: call it from a thread, or before a loop starts.
"""
from __future__ import annotations

import os
import re
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from .errors import ClutorError
from .units import format_bytes

__all__ = ["HubRef", "GGUFSet", "CachedModel", "parse_ref", "looks_like_ref", "hub_cache_dir", "gguf_sets",
           "choose", "resolve", "find_cached", "pull", "list_cached", "remove"]

DEFAULT_QUANTS = ("Q4_K_M", "Q8_0")  # llama.cpp's choice when the name has no tag
_NOT_MODELS = ("mmproj", "imatrix", "mtp-", "eagle3-", "dflash-", "dspark-")  # GGUF files that are not models
_SPLIT = re.compile(r"^(?P<prefix>.+)-(?P<no>\d{5})-of-(?P<count>\d{5})\.gguf$", re.IGNORECASE)
_TAG = re.compile(r"[-.]([A-Z0-9_]+)$", re.IGNORECASE)  # the quant tag ending a file's stem (llama.cpp's rule)
_REPO = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")


@dataclass(frozen=True)
class HubRef:
    """``REPO[:QUANT]``: a Hub model repo and the quant (or file path) wanted in it."""

    repo: str
    quant: str | None = None
    revision: str = "main"

    def __str__(self) -> str:
        return self.repo + (f":{self.quant}" if self.quant else "")


def parse_ref(text: str) -> HubRef:
    """``owner/name``, ``owner/name:Q4_K_M`` or ``owner/name:path/in/repo.gguf``; ClutorError otherwise."""
    repo, _, quant = text.strip().partition(":")
    if not _REPO.fullmatch(repo) or repo.endswith((".", "-")) or ".." in repo:
        raise ClutorError(f"{text!r}: expected a Hugging Face model as OWNER/NAME[:QUANT], "
                          "e.g. Qwen/Qwen3-30B-A3B-GGUF:Q4_K_M")
    if ":" in text and not quant.strip():
        raise ClutorError(f"{text!r}: nothing after ':' (a quant such as Q4_K_M, or a .gguf file in the repo)")
    from huggingface_hub.errors import HFValidationError
    from huggingface_hub.utils import validate_repo_id

    try:  # the Hub's own rules (length, "--", leading and trailing marks)
        validate_repo_id(repo)
    except HFValidationError as e:
        raise ClutorError(f"{text!r}: not a Hugging Face repo name: {_hub_rule(str(e))}") from None
    return HubRef(repo, quant.strip() or None)


def _hub_rule(message: str) -> str:
    """huggingface_hub's message without the name it repeats (``...: 'name'.``)."""
    return re.sub(r":\s*'[^']*'\.?$", "", message.strip()).rstrip(".")


def looks_like_ref(text: str) -> bool:
    """A command's MODEL argument is a Hub name when it is no file here and reads OWNER/NAME[:QUANT]
    (a missing ``dir/model.gguf`` stays a path, so its error names the file)."""
    if os.path.exists(text):
        return False
    repo, _, quant = text.partition(":")
    return bool(_REPO.fullmatch(repo)) and not repo.lower().endswith(".gguf")


# -- where things are -------------------------------------------------------------------------------
def hub_cache_dir() -> Path:
    """huggingface_hub's cache directory, read from the environment now (its own constant is read at import)."""
    if os.environ.get("HF_HUB_CACHE"):
        return Path(os.path.expanduser(os.environ["HF_HUB_CACHE"]))
    home = os.environ.get("HF_HOME") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache"), "huggingface")
    return Path(os.path.expanduser(home)) / "hub"


def _endpoint() -> str:
    return (os.environ.get("HF_ENDPOINT") or "https://huggingface.co").rstrip("/")


def _offline_env() -> bool:
    return (os.environ.get("HF_HUB_OFFLINE") or "").strip().upper() in ("1", "ON", "YES", "TRUE")


def _repo_dir(cache: Path, repo: str) -> Path:
    return cache / ("models--" + repo.replace("/", "--"))


# -- which files are a model ------------------------------------------------------------------------
@dataclass(frozen=True)
class GGUFSet:
    """One model in a repo: one .gguf file, or every part of a split set (part 1 first)."""

    files: tuple[str, ...]              # paths in the repo
    sizes: tuple[int | None, ...]       # bytes of each (None: unknown)
    parts: int = 1                      # the set's part count, from the names (-0000k-of-0000N)

    @property
    def complete(self) -> bool:
        return len(self.files) == self.parts

    @property
    def nbytes(self) -> int:
        return sum(s or 0 for s in self.sizes)

    @property
    def quant(self) -> str | None:
        """The tag ending the file's stem, upper-cased (``Q4_K_M``), or None."""
        m = _TAG.search(_stem(self.files[0]))
        return m.group(1).upper() if m else None

    def name(self, repo: str) -> str:
        """How to ask for this set: ``REPO:QUANT``, or ``REPO:FILE`` when the quant does not single it out."""
        return f"{repo}:{self.quant or self.files[0]}"


def _stem(path: str) -> str:
    """A file name without .gguf and without the split suffix: ``dir/Model-Q4_K_M``."""
    m = _SPLIT.match(path)
    return m.group("prefix") if m else re.sub(r"\.gguf$", "", path, flags=re.IGNORECASE)


def _is_model(path: str) -> bool:
    base = path.rsplit("/", 1)[-1].lower()
    return base.endswith(".gguf") and not any(k in base for k in _NOT_MODELS)


def gguf_sets(files: dict[str, int | None]) -> list[GGUFSet]:
    """The models among a repo's files ({path: size}), split parts grouped, in path order."""
    groups: dict[tuple[str, int], list[tuple[int, str]]] = {}
    for path in sorted(p for p in files if _is_model(p)):
        m = _SPLIT.match(path)
        key, no = ((m.group("prefix"), int(m.group("count"))), int(m.group("no"))) if m else ((path, 1), 1)
        groups.setdefault(key, []).append((no, path))
    out = []
    for (_, count), parts in groups.items():
        parts.sort()
        paths = tuple(p for _, p in parts)
        out.append(GGUFSet(paths, tuple(files[p] for p in paths), count))
    return sorted(out, key=lambda s: s.files[0])


def _has_tag(path: str, tag: str) -> bool:
    return re.search(rf"(?:^|[-._/]){re.escape(tag)}(?:[-./]|$)", path, re.IGNORECASE) is not None


def choose(sets: list[GGUFSet], ref: HubRef) -> GGUFSet:
    """The set ``ref`` names (see the module docstring), or ClutorError listing what the repo has."""
    if ref.quant and ref.quant.lower().endswith(".gguf"):
        hit = [s for s in sets if ref.quant in s.files]
        if hit:
            return hit[0]
        raise ClutorError(f"{ref}: no such GGUF model file in {ref.repo}; it has: {_menu(sets, ref.repo)}")
    for tag in (ref.quant,) if ref.quant else DEFAULT_QUANTS:
        hit = [s for s in sets if _has_tag(s.files[0], tag)]
        if len(hit) > 1:  # e.g. Q4_K_M in two folders: the one whose own tag is exactly this, if only one is
            exact = [s for s in hit if s.quant == tag.upper()]
            hit = exact if len(exact) == 1 else hit
        if len(hit) == 1:
            return hit[0]
        if hit:
            raise ClutorError(f"{ref}: {len(hit)} models match {tag}: " + ", ".join(s.files[0] for s in hit)
                              + f"; name one as {ref.repo}:FILE")
    if not ref.quant and sets:
        return sets[0]
    if not sets:
        raise ClutorError(f"{ref.repo}: no GGUF model in this repo (Clutor runs GGUF files; look for a repo "
                          "whose name ends in -GGUF)")
    raise ClutorError(f"{ref}: no {ref.quant} model in {ref.repo}; it has: {_menu(sets, ref.repo)}")


def _menu(sets: list[GGUFSet], repo: str) -> str:
    return ", ".join(s.name(repo).split(":", 1)[1] + (f" ({format_bytes(s.nbytes)})" if s.nbytes else "")
                     for s in sets) or "none"


# -- the Hub ----------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Resolved:
    ref: HubRef
    commit: str
    set: GGUFSet
    source: str      # "hub" or "cache"


class _Unreachable(Exception):
    """The Hub did not answer (no network, offline mode, a connection dropped)."""


def _hub_call(ref: HubRef, fn):
    """fn() with huggingface_hub's errors turned into ClutorError (the Hub's answers) or _Unreachable."""
    from huggingface_hub.errors import HfHubHTTPError, OfflineModeIsEnabled
    from huggingface_hub.utils import _http

    client = getattr(_http, "httpx2", None) or getattr(_http, "httpx", None)  # huggingface_hub 2.x / 1.x
    transport = (OfflineModeIsEnabled,) + ((client.TransportError,) if client is not None else ())
    try:
        return fn()
    except HfHubHTTPError as e:  # before the transport errors: it is an OSError and an HTTPError too
        raise _hub_error(ref, e) from None
    except transport as e:
        raise _Unreachable(f"{type(e).__name__}: {str(e).strip() or 'no answer'}") from None


def _hub_error(ref: HubRef, e: BaseException) -> ClutorError:
    from huggingface_hub import errors as he

    ep = _endpoint()
    if isinstance(e, he.GatedRepoError):
        return ClutorError(f"{ref.repo}: a gated repo: accept its terms at {ep}/{ref.repo}, then set HF_TOKEN "
                           "(a read token from your Hub settings)")
    if isinstance(e, he.RepositoryNotFoundError):
        return ClutorError(f"{ref.repo}: no such model on {ep} (a private repo needs HF_TOKEN)")
    if isinstance(e, he.RevisionNotFoundError):
        return ClutorError(f"{ref.repo}: no revision {ref.revision!r}")
    if isinstance(e, he.RemoteEntryNotFoundError):
        return ClutorError(f"{ref}: a file listed by {ep} is missing there: {str(e).splitlines()[-1]}")
    status = getattr(getattr(e, "response", None), "status_code", None)
    first = (str(e).strip().splitlines() or [type(e).__name__])[0]
    return ClutorError(f"{ref.repo}: {ep} answered " + (f"{status}: " if status else "") + first)


def _remote(ref: HubRef, token) -> tuple[str, dict[str, int | None]]:
    """(commit, {path: size}) of the repo at ref.revision, asked of the Hub (GET /api/models/REPO/revision/REV)."""
    from huggingface_hub import HfApi

    info = HfApi(endpoint=_endpoint()).model_info(ref.repo, revision=ref.revision, files_metadata=True, token=token)
    files = {s.rfilename: (s.lfs.size if s.lfs is not None else s.size) for s in info.siblings or ()}
    return info.sha, files


def _cached(ref: HubRef, cache: Path) -> tuple[str, dict[str, int | None]] | None:
    """(commit, {path: size}) of what the cache holds for ref.revision (files whose blob is there), or None."""
    root = _repo_dir(cache, ref.repo)
    commit = ref.revision
    if not re.fullmatch(r"[0-9a-f]{40}", commit):
        try:
            commit = (root / "refs" / ref.revision).read_text().strip()
        except OSError:
            return None
    snap = root / "snapshots" / commit
    if not snap.is_dir():
        return None
    files: dict[str, int | None] = {}
    for dirpath, _, names in os.walk(snap):
        for n in names:
            p = Path(dirpath) / n
            try:
                size = p.stat().st_size  # follows the symlink: a dangling one is not cached
            except OSError:
                continue
            files[p.relative_to(snap).as_posix()] = size
    return commit, files


def resolve(ref: HubRef, *, offline: bool = False, cache_dir: str | os.PathLike | None = None,
            token: str | bool | None = None, say: Callable[[str], None] | None = None) -> Resolved:
    """Which files ``ref`` means: asked of the Hub, or from the cache when offline (or the Hub is out of
    reach, said through ``say``)."""
    cache = Path(cache_dir) if cache_dir is not None else hub_cache_dir()
    unreachable = None
    if not (offline or _offline_env()):
        try:
            commit, files = _hub_call(ref, lambda: _remote(ref, token))
            return Resolved(ref, commit, choose(gguf_sets(files), ref), "hub")
        except _Unreachable as e:
            unreachable = f"cannot reach {_endpoint()} ({e})"
    why = unreachable or "offline (--offline or HF_HUB_OFFLINE)"
    local = _cached(ref, cache)
    if local is None:
        raise ClutorError(f"{ref}: {why}, and nothing of {ref.repo} is in the Hub cache {cache}")
    commit, files = local
    sets = gguf_sets(files)
    try:
        chosen = choose(sets, ref)
    except ClutorError:
        raise ClutorError(f"{ref}: {why}, and the Hub cache holds only {_menu(sets, ref.repo)} of {ref.repo}") from None
    if not chosen.complete:
        raise ClutorError(f"{ref}: {why}, and only {len(chosen.files)} of the {chosen.parts} parts of "
                          f"{chosen.files[0]} are cached")
    if unreachable and say:
        say(f"{unreachable}: using the cached copy")
    return Resolved(ref, commit, chosen, "cache")


def find_cached(ref: HubRef, cache_dir: str | os.PathLike | None = None) -> Path | None:
    """The local path of ``ref``'s first part when the whole set is cached (no network), else None."""
    cache = Path(cache_dir) if cache_dir is not None else hub_cache_dir()
    local = _cached(ref, cache)
    if local is None:
        return None
    commit, files = local
    try:
        chosen = choose(gguf_sets(files), ref)
    except ClutorError:
        return None
    if not chosen.complete:
        return None
    return _repo_dir(cache, ref.repo) / "snapshots" / commit / chosen.files[0]


def _stderr(msg: str) -> None:
    print(f"clutor: {msg}", file=sys.stderr, flush=True)


def pull(ref: HubRef | str, *, offline: bool = False, cache_dir: str | os.PathLike | None = None,
         token: str | bool | None = None, say: Callable[[str], None] | None = _stderr,
         progress: bool | None = None) -> Path:
    """Download ``ref``'s file(s) into the Hub cache (what is there already is kept, a partial file is
    resumed) and return the local path of its first part, which Model.open takes.

    progress: a progress bar per file (default: when stderr is a terminal; otherwise one line per file)."""
    ref = parse_ref(ref) if isinstance(ref, str) else ref
    cache = Path(cache_dir) if cache_dir is not None else hub_cache_dir()
    say = say or (lambda _msg: None)
    r = resolve(ref, offline=offline, cache_dir=cache, token=token, say=say)
    chosen = r.set
    parts = f" (+{len(chosen.files) - 1} parts)" if len(chosen.files) > 1 else ""
    where = _repo_dir(cache, ref.repo) / "snapshots" / r.commit
    if r.source == "cache":
        say(f"{chosen.name(ref.repo)}: {chosen.files[0]}{parts}, {format_bytes(chosen.nbytes)}, cached")
        return where / chosen.files[0]
    missing = [(f, s) for f, s in zip(chosen.files, chosen.sizes) if not (where / f).exists()]
    need = sum(s or 0 for _, s in missing)
    say(f"{chosen.name(ref.repo)}: {chosen.files[0]}{parts}, {format_bytes(chosen.nbytes)} at commit {r.commit[:10]}"
        + (f"; downloading {format_bytes(need)} into {cache}" if missing else ", cached"))
    if not missing:
        _set_ref(cache, ref, r.commit)
    else:
        _check_space(cache, need)
    bar = sys.stderr.isatty() if progress is None else progress
    for f, size in missing:
        if not bar:
            say(f"downloading {f} ({format_bytes(size) if size else 'size unknown'})")
        _download(ref.repo, f, r.commit, cache, token, bar)
    _set_ref(cache, ref, r.commit)
    return where / chosen.files[0]


def _set_ref(cache: Path, ref: HubRef, commit: str) -> None:
    """refs/REVISION -> commit, as huggingface_hub records a branch it resolved (downloads by commit
    hash, as here, do not): what offline use and other Hub tools look up."""
    if re.fullmatch(r"[0-9a-f]{40}", ref.revision):
        return
    path = _repo_dir(cache, ref.repo) / "refs" / ref.revision
    try:
        if path.read_text() == commit:
            return
    except OSError:
        pass
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(commit)
    os.replace(tmp, path)


def _check_space(cache: Path, need: int) -> None:
    probe = cache
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    free = shutil.disk_usage(probe).free
    if need > free:
        raise ClutorError(f"{cache}: the download needs {format_bytes(need)}, {format_bytes(free)} is free there "
                          "(HF_HUB_CACHE puts the cache elsewhere)")


def _quiet_tqdm():
    from tqdm.auto import tqdm

    class Quiet(tqdm):
        def __init__(self, *a, **kw):
            kw["disable"] = True
            super().__init__(*a, **kw)

    return Quiet


def _download(repo: str, filename: str, commit: str, cache: Path, token, bar: bool) -> None:
    """One file into the cache: a plain HTTP blob fetched resumably first, then huggingface_hub links
    it into the snapshot (and fetches Xet-stored files itself)."""
    from huggingface_hub import get_hf_file_metadata, hf_hub_download, hf_hub_url

    ep = _endpoint()
    tqdm_class = None if bar else _quiet_tqdm()
    ref = HubRef(repo, filename)

    def fetch():
        meta = get_hf_file_metadata(hf_hub_url(repo, filename, revision=commit, endpoint=ep), token=token,
                                    endpoint=ep)
        if meta.xet_file_data is None and meta.etag:
            _fetch_blob(repo, filename, meta, cache, token, tqdm_class)
        hf_hub_download(repo, filename, revision=commit, cache_dir=cache, endpoint=ep, token=token,
                        tqdm_class=tqdm_class)

    try:
        _hub_call(ref, fetch)
    except _Unreachable as e:
        raise ClutorError(f"{ref}: the download stopped ({e}); the same command resumes it") from None


def _fetch_blob(repo: str, filename: str, meta, cache: Path, token, tqdm_class) -> None:
    """blobs/ETAG from meta.location, continued from blobs/ETAG.incomplete if an earlier run left one.
    Under the lock huggingface_hub takes for the same blob, so two pulls never write one file."""
    from huggingface_hub.file_download import http_get
    from huggingface_hub.utils import WeakFileLock, build_hf_headers

    root = _repo_dir(cache, repo)
    blob = root / "blobs" / meta.etag
    if blob.exists():
        return
    blob.parent.mkdir(parents=True, exist_ok=True)
    lock = cache / ".locks" / root.name / f"{meta.etag}.lock"
    lock.parent.mkdir(parents=True, exist_ok=True)
    partial = blob.with_name(meta.etag + ".incomplete")
    headers = build_hf_headers(token=token)
    if _origin(meta.location) != _origin(_endpoint()):
        headers.pop("authorization", None)  # a signed CDN address: the token stays with the Hub
    with WeakFileLock(lock):
        if blob.exists():
            return
        have = partial.stat().st_size if partial.exists() else 0
        if meta.size is not None and have > meta.size:  # not a prefix of this blob: start over
            partial.unlink()
            have = 0
        with open(partial, "ab") as f:
            http_get(meta.location, f, resume_size=have, headers=headers, expected_size=meta.size,
                     displayed_filename=filename, tqdm_class=tqdm_class)
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(partial, 0o666 & ~umask)
        os.replace(partial, blob)


def _origin(url: str) -> tuple[str, str, int | None]:
    from urllib.parse import urlsplit

    u = urlsplit(url)
    return u.scheme, (u.hostname or "").lower(), u.port or {"http": 80, "https": 443}.get(u.scheme)


# -- what is cached ---------------------------------------------------------------------------------
@dataclass(frozen=True)
class CachedModel:
    name: str                 # REPO:QUANT (or REPO:FILE)
    repo: str
    commit: str
    refs: tuple[str, ...]     # branches pointing at this commit ("main")
    set: GGUFSet
    path: Path                # the first part in the snapshot (what Model.open takes)
    partial_bytes: int = 0    # of an interrupted download of this repo (reported on its first row)


def list_cached(cache_dir: str | os.PathLike | None = None) -> list[CachedModel]:
    """Every GGUF model in the Hub cache, read with huggingface_hub's own scanner (sizes as on disk)."""
    from huggingface_hub import scan_cache_dir
    from huggingface_hub.errors import CacheNotFound

    cache = Path(cache_dir) if cache_dir is not None else hub_cache_dir()
    try:
        info = scan_cache_dir(cache)
    except CacheNotFound:
        return []
    partial: dict[Path, int] = {}
    for inc in getattr(info, "incomplete_files", ()):
        root = inc.file_path.parent.parent
        partial[root] = partial.get(root, 0) + inc.size_on_disk
    out = []
    for repo in sorted(info.repos, key=lambda r: r.repo_id):
        if repo.repo_type != "model":
            continue
        extra = partial.get(repo.repo_path, 0)
        for rev in sorted(repo.revisions, key=lambda r: -r.last_modified):
            files = {f.file_path.relative_to(rev.snapshot_path).as_posix(): f.size_on_disk for f in rev.files}
            for s in gguf_sets(files):
                out.append(CachedModel(s.name(repo.repo_id), repo.repo_id, rev.commit_hash, tuple(sorted(rev.refs)),
                                       s, rev.snapshot_path / s.files[0], extra))
                extra = 0
        if extra:  # a download that never completed a file
            out.append(CachedModel(f"{repo.repo_id} (partial download)", repo.repo_id, "", (), GGUFSet((), (), 0),
                                   repo.repo_path, extra))
    return out


def remove(ref: HubRef | str, cache_dir: str | os.PathLike | None = None) -> tuple[int, int]:
    """Delete ``REPO`` (everything cached of it) or ``REPO:QUANT`` (that model's files in every cached
    revision; blobs other files still use are kept). Returns (files removed, bytes freed)."""
    from huggingface_hub import scan_cache_dir
    from huggingface_hub.errors import CacheNotFound

    ref = parse_ref(ref) if isinstance(ref, str) else ref
    cache = Path(cache_dir) if cache_dir is not None else hub_cache_dir()
    try:
        info = scan_cache_dir(cache)
    except CacheNotFound:
        info = None
    repo = next((r for r in info.repos if r.repo_id == ref.repo and r.repo_type == "model"), None) if info else None
    if repo is None:
        raise ClutorError(f"{ref.repo}: not in the Hub cache ({cache}); `clutor list` shows what is")
    if ref.quant is None:
        strategy = info.delete_revisions(*(r.commit_hash for r in repo.revisions))
        n = repo.nb_files
        freed = strategy.expected_freed_size
        strategy.execute()
        shutil.rmtree(repo.repo_path, ignore_errors=True)  # partial downloads, .no_exist markers
        return n, freed
    doomed = []
    for rev in repo.revisions:
        files = {f.file_path.relative_to(rev.snapshot_path).as_posix(): f for f in rev.files}
        try:
            chosen = choose(gguf_sets({p: f.size_on_disk for p, f in files.items()}), ref)
        except ClutorError:
            continue
        doomed += [files[p] for p in chosen.files]
    if not doomed:
        have = sorted({m.name for m in list_cached(cache) if m.repo == ref.repo})
        raise ClutorError(f"{ref}: not cached; cached from {ref.repo}: {', '.join(have) or 'no GGUF model'}")
    return len(doomed), _delete_files(info, doomed)


def _delete_files(info, doomed) -> int:
    """Unlink the snapshot entries, then the blobs no remaining entry uses; the bytes freed."""
    if hasattr(info, "delete_files"):  # huggingface_hub's own (it also keeps its shared blob store right)
        strategy = info.delete_files(*doomed)
        freed = strategy.expected_freed_size
        strategy.execute()
        return freed
    kept = {f.blob_path for r in info.repos for rev in r.revisions for f in rev.files if f not in set(doomed)}
    freed = 0
    for f in doomed:
        f.file_path.unlink(missing_ok=True)
    for blob in {f.blob_path: f.size_on_disk for f in doomed if f.blob_path not in kept}.items():
        Path(blob[0]).unlink(missing_ok=True)
        freed += blob[1]
    return freed
