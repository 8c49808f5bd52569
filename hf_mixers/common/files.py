"""Writing outputs so that nothing half-written is ever seen: one place for every command.

    write_atomically(path, write)       a file: ``write(temporary path)``, then renamed onto ``path``
    save_atomically(model, out_dir)     a model folder: saved into a sibling staging folder, renamed when complete
    check_output_folder(out_dir)        refuse a non-empty folder unless overwrite, before any work starts
    staging_folder(out_dir)             the sibling folder a writer fills before renaming it onto out_dir
    cache_folder(name)                  $HF_MIXERS_CACHE/name (default ~/.cache/hf-mixers/name): what can be rebuilt
    removed_unless_started(out_dir)     a training run's folder: what a run that fails before it starts made is removed

Staging names carry the writer's process id (``.NAME.partial-<pid>-...``), so a later run removes the leftovers of a
writer that was killed (its pid is gone) and leaves a live writer's alone. Finished outputs get the usual mode for
new files under the process's umask (``mkdtemp`` alone would leave the folder 0700, unreadable to a team).
"""

from __future__ import annotations

import contextlib
import glob
import os
import re
import shutil
import tempfile

_PARTIAL = re.compile(r"\.partial-(\d+)-")


def cache_folder(name: str) -> str:
    """Where the toolkit keeps what it can rebuild (teacher-written text, decoded GGUF teachers): $HF_MIXERS_CACHE/name,
    default ~/.cache/hf-mixers/name."""
    root = os.environ.get("HF_MIXERS_CACHE") or os.path.join("~", ".cache", "hf-mixers")
    return os.path.join(os.path.expanduser(root), name)


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's live process
        return True
    return True


def remove_stale_partials(path: str) -> list[str]:
    """Remove the staging leftovers of ``path`` whose writer process is gone; returns what was removed."""
    parent, name = os.path.split(os.path.abspath(path))
    removed = []
    for leftover in glob.glob(os.path.join(glob.escape(parent), f".{glob.escape(name)}.partial-*")):
        match = _PARTIAL.search(os.path.basename(leftover))
        if match and int(match.group(1)) != os.getpid() and not _alive(int(match.group(1))):
            shutil.rmtree(leftover, ignore_errors=True) if os.path.isdir(leftover) else os.remove(leftover)
            removed.append(leftover)
    return removed


def finish_modes(path: str) -> None:
    """Directories rwx and files rw for everyone the umask allows (what a plain mkdir / open would have given)."""
    mask = _umask()
    if os.path.isdir(path):
        for root, dirs, files in os.walk(path):
            os.chmod(root, 0o777 & ~mask)
            for name in files:
                os.chmod(os.path.join(root, name), 0o666 & ~mask)
    else:
        os.chmod(path, 0o666 & ~mask)


def write_atomically(path: str, write) -> str:
    """Call ``write(temporary)`` to write a file, then rename it onto ``path`` (text: pass a str instead)."""
    path = os.path.abspath(path)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    remove_stale_partials(path)
    handle, temporary = tempfile.mkstemp(prefix=f".{os.path.basename(path)}.partial-{os.getpid()}-",
                                         dir=os.path.dirname(path))
    os.close(handle)
    try:
        if isinstance(write, str):
            with open(temporary, "w", encoding="utf-8") as stream:
                stream.write(write)
        else:
            write(temporary)
        finish_modes(temporary)
        os.replace(temporary, path)
    except BaseException as error:
        if os.path.exists(temporary):
            os.remove(temporary)
        raise as_os_error(error, path) from error
    return path


# the OS error inside a SafetensorError's text, in the forms safetensors has printed: Rust's Display
# ("I/O error: File too large (os error 27)", the pinned version) and its Debug ("Os { code: 28, ... message: "...")
_SAFETENSORS_OS_ERROR = (re.compile(r'(?:I/O error: )?(?P<message>[^:]+?) \(os error (?P<code>\d+)\)'),
                         re.compile(r'code: (?P<code>\d+),.*?message: "(?P<message>[^"]+)"'))


def as_os_error(error: BaseException, path: str) -> BaseException:
    """safetensors reports a failed write (a full disk, a file-size limit) as a SafetensorError whose text holds the
    OS error: the OSError it stands for, naming ``path``, so the command reports it as the fault it is. Any other
    error comes back unchanged."""
    if type(error).__name__ != "SafetensorError":
        return error
    for form in _SAFETENSORS_OS_ERROR:
        found = form.search(str(error))
        if found is not None:
            return OSError(int(found.group("code")), f"{found.group('message').strip()} (writing {path})")
    return error


def check_output_folder(out_dir: str, overwrite: bool) -> str:
    """The absolute output path; an existing non-empty folder is refused unless ``overwrite``."""
    out_dir = os.path.abspath(out_dir)
    if os.path.isfile(out_dir):
        raise FileExistsError(f"{out_dir} is a file, not a folder")
    ancestor = os.path.dirname(out_dir)
    while not os.path.exists(ancestor):
        ancestor = os.path.dirname(ancestor)
    if not os.path.isdir(ancestor):
        raise FileExistsError(f"{out_dir}: cannot create it, {ancestor} is a file, not a folder")
    if os.path.isdir(out_dir) and os.listdir(out_dir) and not overwrite:
        raise FileExistsError(f"{out_dir} exists and is not empty; pass overwrite=True (--overwrite) to replace it")
    return out_dir


def check_report_files(out_dir: str, names, overwrite: bool) -> str:
    """The absolute output folder of a command that writes the reports ``names`` into it (bench, diagnose,
    reproduce, eval): a folder under a file is refused, and so is an earlier run's report unless ``overwrite``, so
    no command replaces finished results silently."""
    out_dir = check_output_folder(out_dir, overwrite=True)
    earlier = [name for name in names if os.path.exists(os.path.join(out_dir, name))]
    if earlier and not overwrite:
        raise FileExistsError(f"{os.path.join(out_dir, earlier[0])} exists (an earlier run's); pass --overwrite to "
                              f"replace it, or choose another --out")
    return out_dir


def _started(out_dir: str) -> bool:
    """Whether a training run in ``out_dir`` has got anywhere: a checkpoint saved, or a step logged."""
    metrics = os.path.join(out_dir, "metrics.jsonl")
    return bool(glob.glob(os.path.join(out_dir, "checkpoints", "*.safetensors"))) or (
        os.path.isfile(metrics) and os.path.getsize(metrics) > 0)


@contextlib.contextmanager
def removed_unless_started(out_dir: str):
    """Around a training run: if it fails (or is interrupted) before its first logged step or checkpoint, what it
    created in ``out_dir`` (recipe.json, the packed data, the trackers' folders, an empty checkpoints folder) is
    removed, and ``out_dir`` itself if the run made it; what was there before stays. Rank 0 of a launch cleans up."""
    existed = os.path.isdir(out_dir)
    before = set(os.listdir(out_dir)) if existed else set()
    try:
        yield
    except BaseException:
        if int(os.environ.get("RANK", "0")) == 0 and os.path.isdir(out_dir) and not _started(out_dir):
            try:
                for name in set(os.listdir(out_dir)) - before:
                    path = os.path.join(out_dir, name)
                    if os.path.isdir(path):
                        shutil.rmtree(path, ignore_errors=True)
                    else:
                        os.remove(path)
                if not existed and not os.listdir(out_dir):
                    os.rmdir(out_dir)
            except OSError:  # a cleanup that cannot finish never replaces the error that brought us here
                pass
        raise


def staging_folder(out_dir: str) -> str:
    """A new empty sibling of ``out_dir`` to write it in (``.NAME.partial-<pid>-...``), once the leftovers of killed
    writers are removed; the caller gives it the usual modes (``finish_modes``) and renames it onto ``out_dir``."""
    parent = os.path.dirname(os.path.abspath(out_dir))
    os.makedirs(parent, exist_ok=True)
    remove_stale_partials(out_dir)
    return tempfile.mkdtemp(prefix=f".{os.path.basename(out_dir)}.partial-{os.getpid()}-", dir=parent)


def save_atomically(model, out_dir: str, tokenizer=None, overwrite: bool = False, extra=None, **save_kwargs) -> str:
    """Save ``model`` (and ``tokenizer``) into ``out_dir`` via a temporary sibling folder renamed when complete.

    ``extra(folder)`` may write more files (reports) into the folder before the rename. An existing non-empty
    ``out_dir`` is refused unless ``overwrite``; nothing half-written is ever left there, and the leftovers of a
    killed earlier run are removed.
    """
    out_dir = check_output_folder(out_dir, overwrite)
    staging = staging_folder(out_dir)
    try:
        model.save_pretrained(staging, **save_kwargs)
        if tokenizer is not None:
            tokenizer.save_pretrained(staging)
        if extra is not None:
            extra(staging)
        finish_modes(staging)
        if os.path.exists(out_dir):
            shutil.rmtree(out_dir)
        os.replace(staging, out_dir)
    except BaseException as error:
        shutil.rmtree(staging, ignore_errors=True)
        raise as_os_error(error, out_dir) from error
    return out_dir
