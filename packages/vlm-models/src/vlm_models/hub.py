"""Turn a model name into something a trainer or engine can load without the network.

A shape preset name (``qwen3-vl-8b``, ``qwen3-vl-tiny``) stays a name: it is the one explicit way
to ask for random weights. A local folder stays a folder (a run folder stands for its exported
``hf/``). Anything else is a hub id, downloaded once with ``huggingface_hub.snapshot_download``
(``HF_HOME`` and ``HF_HUB_OFFLINE`` honoured) into the local cache, and the snapshot folder is
returned, so that every process after it reads files only. A name that cannot be resolved is a
:class:`ModelSourceError` at once, never a silent random model.
"""

from __future__ import annotations

import logging
from pathlib import Path

from vlm_models.config import ModelSourceError
from vlm_models.presets import PRESETS

logger = logging.getLogger(__name__)

#: The files a model folder needs (weights, configs, tokenizer, chat template); no .bin/.pt.
HUB_FILES = ["*.json", "*.safetensors", "*.txt", "*.jinja", "*.model", "*.tiktoken"]
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth")


def has_weights(folder: str | Path) -> bool:
    """Whether ``folder`` holds weight files (not just a ``config.json``)."""
    return any(p.name.endswith(_WEIGHT_SUFFIXES) for p in Path(folder).iterdir())


def _looks_like_path(name: str) -> bool:
    return name.startswith(("/", ".", "~")) or name.count("/") > 1


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
    if name in PRESETS:
        return name
    path = Path(name).expanduser()
    if path.exists():
        return str(_model_folder(path, name, require_weights))
    if _looks_like_path(name):
        raise ModelSourceError(f"model {name!r}: no such folder")
    repo_id = name if "/" in name else (f"{hub_namespace}/{name}" if hub_namespace else None)
    if repo_id is None:
        raise ModelSourceError(
            f"model {name!r} is not a preset ({', '.join(PRESETS)}), a folder or a hub id (org/name)"
        )
    return str(_model_folder(download(repo_id, timeout=timeout), name, require_weights))


def _model_folder(path: Path, name: str, require_weights: bool) -> Path:
    if (path / "hf" / "config.json").is_file():  # a run folder: its exported weights
        path = path / "hf"
    if not (path / "config.json").is_file():
        raise ModelSourceError(f"model {name!r}: {path} has no config.json (nor hf/config.json)")
    if require_weights and not has_weights(path):
        raise ModelSourceError(
            f"model {name!r}: {path} has a config.json but no weights; for random weights of a "
            f"shape, name a preset ({', '.join(PRESETS)})"
        )
    return path


def download(repo_id: str, *, timeout: float = 10.0) -> Path:
    """The local snapshot folder of hub model ``repo_id`` (downloaded into the HF cache once).

    ``snapshot_download`` asks the hub for the revision with no timeout of its own, so a short
    ``repo_info`` call goes first: an unreachable hub then fails within ``timeout`` and falls
    back to the cache, an unknown id fails at once. Offline mode reads the cache only.
    """
    from huggingface_hub import HfApi, constants, snapshot_download
    from huggingface_hub.errors import (
        GatedRepoError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
    )

    hint = "download it elsewhere and pass the local folder instead"
    offline = constants.HF_HUB_OFFLINE
    if not offline:
        try:
            HfApi().repo_info(repo_id, timeout=timeout)
        except (RepositoryNotFoundError, GatedRepoError) as err:
            raise ModelSourceError(
                f"model {repo_id!r}: not found on the Hugging Face Hub, or not accessible "
                f"({type(err).__name__}); {hint}"
            ) from None
        except Exception as err:  # no route, DNS failure, timeout, proxy, server error
            logger.warning("cannot reach the Hugging Face Hub for %s (%s)", repo_id, err)
            offline = True  # look in the cache only
    try:
        folder = snapshot_download(
            repo_id,
            allow_patterns=HUB_FILES,
            etag_timeout=timeout,
            local_files_only=offline,
        )
    except LocalEntryNotFoundError:
        why = "HF_HUB_OFFLINE is set" if constants.HF_HUB_OFFLINE else "the hub is not reachable"
        raise ModelSourceError(
            f"model {repo_id!r}: {why} and it is not in the local cache "
            f"({constants.HF_HUB_CACHE}); {hint}"
        ) from None
    except Exception as err:  # a download that failed half way, a full disk
        raise ModelSourceError(f"model {repo_id!r}: download failed ({err}); {hint}") from None
    logger.info("model %s: %s", repo_id, folder)
    return Path(folder)
