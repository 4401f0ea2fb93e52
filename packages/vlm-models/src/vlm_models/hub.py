"""Turn a model name into something a trainer or engine can load without the network.

A shape preset name (``qwen3-vl-8b``, ``qwen3-vl-tiny``) stays a name: it is the one explicit way
to ask for random weights. A local folder stays a folder (a run folder stands for its exported
``hf/``). Anything else is a hub id, downloaded once with ``huggingface_hub.snapshot_download``
(``HF_HOME`` and ``HF_HUB_OFFLINE`` honoured) into the local cache, and the snapshot folder is
returned, so that every process after it reads files only. A name that cannot be resolved is a
:class:`ModelSourceError` at once, never a silent random model.

:func:`check_model` asks the same questions without downloading, before a launcher prints or
writes anything. This module imports neither torch nor transformers (the presets are imported
where a name is resolved), and huggingface_hub only for a hub id.
"""

from __future__ import annotations

import functools
import logging
import os
import re
from pathlib import Path

from vlm_models.config import (
    HUB_NAMESPACE,
    PRESET_NAMES,
    TINY_MODEL,
    ModelConfig,
    ModelSourceError,
)

logger = logging.getLogger(__name__)

#: The files a model folder needs (weights, configs, tokenizer, chat template); no .bin/.pt.
HUB_FILES = ["*.json", "*.safetensors", "*.txt", "*.jinja", "*.model", "*.tiktoken"]
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth")


def has_weights(folder: str | Path) -> bool:
    """Whether ``folder`` holds weight files (not just a ``config.json``)."""
    return any(p.name.endswith(_WEIGHT_SUFFIXES) for p in Path(folder).iterdir())


def looks_like_path(name: str) -> bool:
    """Whether ``name`` is written as a path (``/x``, ``./x``, ``../x``, ``~/x``, or with a
    separator and not ``owner/name`` shaped): one that does not exist is then a missing path,
    never a hub id. (vlm_data's datasets follow the same rule.)"""
    if name in (".", "..") or name.startswith(("/", "./", "../", "~")):
        return True
    separators = [s for s in (os.sep, os.altsep) if s]
    return any(s in name for s in separators) and not _HUB_ID.fullmatch(name)


_HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")  # owner/name


def resolve_model_source(
    name: str,
    *,
    hub_namespace: str | None = None,
    timeout: float = 10.0,
    require_weights: bool = False,
) -> str:
    """A preset name, or a local folder holding ``config.json``, for ``name``.

    ``name`` is a preset name, a folder (an HF folder, or a run folder with ``hf/``), a hub id
    (``org/model``), or with ``hub_namespace`` a bare model name (``Qwen3-VL-8B-Instruct`` ->
    ``Qwen/Qwen3-VL-8B-Instruct``). Hub ids are downloaded (or found in the cache); without a
    network the call fails within about ``timeout`` seconds. ``require_weights`` refuses a folder
    with a config but no weights, which would otherwise train from random weights.
    """
    from vlm_models.presets import PRESETS  # transformers: only when a name is resolved

    if name in PRESETS:
        return name
    path = _local(name)
    if path is not None:
        return str(_model_folder(path, name, require_weights))
    repo_id = _repo_id(name, hub_namespace)
    return str(_model_folder(download(repo_id, timeout=timeout), name, require_weights))


def check_model(model: ModelConfig, *, load: str | None = None, timeout: float = 10.0) -> None:
    """What `vlm_models.sources.resolve_model` will resolve exists, asked without downloading
    (a launcher checks it before it prints or writes anything): a local folder with its
    ``config.json`` (and weights, for the model), a hub id on the hub or, offline or where the
    hub is not reachable, in the local cache. Raises `ModelSourceError` naming the flag."""
    checks = [("--load", load, False)] if load else [("--model-name", model.model_name, True)]
    if model.tokenizer not in (None, "tiny"):
        checks.append(("--tokenizer", model.tokenizer, False))
    for flag, name, weights in checks:
        try:
            if flag == "--load":
                load_folder(name)
            elif name not in PRESET_NAMES and name != TINY_MODEL:
                _check_source(name, weights, timeout)
        except ModelSourceError as err:
            raise ModelSourceError(f"{flag}: {err}") from None


def _local(name: str) -> Path | None:
    """The local path ``name`` names, None where it names none and is not written as a path;
    a path that does not exist raises."""
    path = Path(name).expanduser()
    if path.exists():
        return path
    if looks_like_path(name):
        raise ModelSourceError(f"{name}: no such file or directory")
    return None


def _repo_id(name: str, hub_namespace: str | None) -> str:
    repo_id = name if "/" in name else (f"{hub_namespace}/{name}" if hub_namespace else None)
    if repo_id is None:
        raise ModelSourceError(
            f"model {name!r} is not a preset ({', '.join(PRESET_NAMES)}), a folder or a hub id "
            "(org/name)"
        )
    return repo_id


def _check_source(name: str, require_weights: bool, timeout: float) -> None:
    path = _local(name)
    if path is not None:
        _model_folder(path, name, require_weights)
        return
    repo_id = _repo_id(name, HUB_NAMESPACE)
    if not _hub_has(repo_id, timeout):  # offline or unreachable: the cache must hold it
        _cached_snapshot(repo_id)


def load_folder(name: str) -> Path:
    """`--load`'s folder, always a local one (a run folder stands for its exported ``hf/``)."""
    path = Path(name).expanduser()
    if not path.exists():
        raise ModelSourceError(f"{name}: no such file or directory")
    if (path / "hf" / "config.json").is_file():
        return path / "hf"
    if not (path / "config.json").is_file():
        raise ModelSourceError(f"{name}: no config.json there (nor in {path / 'hf'})")
    return path


def _model_folder(path: Path, name: str, require_weights: bool) -> Path:
    if (path / "hf" / "config.json").is_file():  # a run folder: its exported weights
        path = path / "hf"
    if not (path / "config.json").is_file():
        raise ModelSourceError(f"model {name!r}: {path} has no config.json (nor hf/config.json)")
    if require_weights and not has_weights(path):
        raise ModelSourceError(
            f"model {name!r}: {path} has a config.json but no weights; for random weights of a "
            f"shape, name a preset ({', '.join(PRESET_NAMES)})"
        )
    return path


_HINT = "download it elsewhere and pass the local folder instead"


def download(repo_id: str, *, timeout: float = 10.0) -> Path:
    """The local snapshot folder of hub model ``repo_id`` (downloaded into the HF cache once).

    ``snapshot_download`` asks the hub for the revision with no timeout of its own, so a short
    ``repo_info`` call goes first: an unreachable hub then fails within ``timeout`` and falls
    back to the cache, an unknown id fails at once. Offline mode reads the cache only.
    """
    from huggingface_hub import constants, snapshot_download

    if not _hub_has(repo_id, timeout):
        if not constants.HF_HUB_OFFLINE:
            logger.warning("cannot reach the Hugging Face Hub for %s: reading the cache", repo_id)
        return _cached_snapshot(repo_id)
    try:
        folder = snapshot_download(repo_id, allow_patterns=HUB_FILES, etag_timeout=timeout)
    except Exception as err:  # a download that failed half way, a full disk
        raise ModelSourceError(f"model {repo_id!r}: download failed ({err}); {_HINT}") from None
    logger.info("model %s: %s", repo_id, folder)
    return Path(folder)


def _hub_has(repo_id: str, timeout: float) -> bool:
    """Whether the hub answers for ``repo_id`` (False: offline, or the hub is not reachable:
    look in the cache); an id the hub does not know raises."""
    from huggingface_hub import constants

    return False if constants.HF_HUB_OFFLINE else _ask_hub(repo_id, timeout)


@functools.cache  # one question a run: the launcher's check, then its download
def _ask_hub(repo_id: str, timeout: float) -> bool:
    from huggingface_hub import HfApi
    from huggingface_hub.errors import GatedRepoError, RepositoryNotFoundError

    try:
        HfApi().repo_info(repo_id, timeout=timeout)
    except (RepositoryNotFoundError, GatedRepoError) as err:
        raise ModelSourceError(
            f"model {repo_id!r}: not found on the Hugging Face Hub, or not accessible "
            f"({type(err).__name__}); {_HINT}"
        ) from None
    except Exception as err:  # no route, DNS failure, timeout, proxy, server error
        logger.debug("cannot reach the Hugging Face Hub for %s (%s)", repo_id, err)
        return False
    return True


def _cached_snapshot(repo_id: str) -> Path:
    """``repo_id``'s folder in the local cache (no network), or a one-line error."""
    from huggingface_hub import constants, snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    try:
        folder = snapshot_download(repo_id, allow_patterns=HUB_FILES, local_files_only=True)
    except LocalEntryNotFoundError:
        why = "HF_HUB_OFFLINE is set" if constants.HF_HUB_OFFLINE else "the hub is not reachable"
        raise ModelSourceError(
            f"model {repo_id!r}: {why} and it is not in the local cache "
            f"({constants.HF_HUB_CACHE}); {_HINT}"
        ) from None
    logger.info("model %s: %s (from the local cache)", repo_id, folder)
    return Path(folder)
