"""``hf-hub:ORG/NAME[@REVISION]`` model names: parsed, fetched into the Hugging Face cache with
``huggingface_hub.snapshot_download`` (which honours ``HF_HUB_OFFLINE`` and reads the cache offline), and
pushed back with ``push_folder``. ``load_model`` and ``finetune.init`` take such a name wherever they take a
folder; what fails fails in one line. Publishing a model: docs/captioning.md ("Sharing on the Hub").
"""

from __future__ import annotations

import json
import os
import re
from importlib.metadata import version
from pathlib import Path

from vitattn.bundle.folder import CONFIG_FILE, is_bundle_folder
from vitattn.bundle.onnx_folder import is_onnx_folder
from vitattn.errors import brief, first_line

__all__ = [
    "HUB_PREFIX",
    "describe_folder",
    "hub_folder",
    "is_hub_name",
    "parse_hub_name",
    "push_folder",
    "resolve_model_path",
]

HUB_PREFIX = "hf-hub:"
# The Hub's own rule for each half of a repository id (huggingface_hub's validate_repo_id).
_PART = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")


def is_hub_name(path: str | os.PathLike) -> bool:
    """Whether ``path`` is a ``hf-hub:`` name rather than a local path."""
    return str(path).startswith(HUB_PREFIX)


def parse_hub_name(name: str) -> tuple[str, str | None]:
    """``hf-hub:ORG/NAME[@REVISION]`` -> ``(ORG/NAME, REVISION or None)``.

    Raises:
        ValueError: no ``hf-hub:`` prefix, no ``ORG/NAME``, more than one ``@``, an empty revision.
    """
    text = str(name)
    if not text.startswith(HUB_PREFIX):
        raise ValueError(f"{brief(text)} is not a Hub model name; write hf-hub:ORG/NAME or hf-hub:ORG/NAME@REVISION")
    repo_id, at, revision = text.removeprefix(HUB_PREFIX).partition("@")
    parts = repo_id.split("/")
    form = "hf-hub:ORG/NAME or hf-hub:ORG/NAME@REVISION"
    if len(parts) != 2 or not all(_PART.fullmatch(p) and ".." not in p and "--" not in p for p in parts):
        raise ValueError(f"{brief(text)} is not a Hub model name: {brief(repo_id)} must be ORG/NAME; write {form}")
    if at and (not revision or "@" in revision or revision != revision.strip()):
        raise ValueError(f"{brief(text)} has a bad revision {brief(revision)}; write {form}")
    return repo_id, revision or None


def _fetch_hint(repo_id: str, revision: str | None) -> str:
    command = f"hf download {repo_id}" + (f" --revision {revision}" if revision else "")
    return f"fetch it where the network is reachable with `{command}` (same HF_HOME), or unset HF_HUB_OFFLINE"


def hub_folder(name: str) -> Path:
    """The folder of the Hub model ``name`` (``hf-hub:ORG/NAME[@REVISION]``) in the Hugging Face cache, downloaded
    when online and not cached; read from the cache, never waited for, when offline.

    Raises:
        ValueError: a malformed name; not cached while offline; no such repository or revision on the Hub.
    """
    from huggingface_hub import constants, snapshot_download
    from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError, RevisionNotFoundError

    repo_id, revision = parse_hub_name(name)
    try:
        return Path(
            snapshot_download(repo_id, revision=revision, library_name="vitattn", library_version=version("vitattn"))
        )
    except LocalEntryNotFoundError:
        why = "HF_HUB_OFFLINE is set" if constants.is_offline_mode() else "the Hub cannot be reached"
        raise ValueError(
            f"{name} is not in the Hugging Face cache ({constants.HF_HUB_CACHE}) and {why}; "
            f"{_fetch_hint(repo_id, revision)}"
        ) from None
    except RevisionNotFoundError:
        raise ValueError(f"{name}: the Hub repository {repo_id} has no revision {revision}") from None
    except HfHubHTTPError as err:  # not found, gated or private (401), or the Hub is down
        raise ValueError(
            f"{name}: {first_line(err)} (a private or gated repository needs `hf auth login` or HF_TOKEN)"
        ) from None


def describe_folder(folder: Path) -> str:
    """What a folder that is neither a vitattn bundle nor an ONNX folder holds, as far as its files tell."""
    try:
        config = json.loads((folder / CONFIG_FILE).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        config = None
    if isinstance(config, dict) and ("pretrained_cfg" in config or "architecture" in config):
        return f"a timm model ({config.get('architecture', 'config.json with pretrained_cfg')})"
    if isinstance(config, dict) and ("model_type" in config or "architectures" in config):
        return f"a transformers model (model_type {config.get('model_type', config.get('architectures'))})"
    return f"no vitattn bundle files ({CONFIG_FILE} of format vitattn-bundle, or onnx.json)"


def resolve_model_path(path: str | os.PathLike) -> Path:
    """The local folder or file of a model path: ``path`` itself, or a ``hf-hub:`` name's folder once it is seen
    to hold a vitattn bundle or ONNX folder.

    Raises:
        ValueError: a malformed or unreachable Hub name (``hub_folder``); a Hub folder of something else.
    """
    if not is_hub_name(path):
        return Path(path)
    folder = hub_folder(str(path))
    if not (is_bundle_folder(folder) or is_onnx_folder(folder)):
        raise ValueError(
            f"{path} is not a vitattn model: the repository holds {describe_folder(folder)}; give a repository "
            "written by vitattn-export format=hub"
        )
    return folder


def push_folder(folder: Path, repo_id: str, private: bool = False) -> str:
    """Upload ``folder`` to the Hub model repository ``repo_id`` (created if missing); returns its URL.

    Raises:
        ValueError: offline (``HF_HUB_OFFLINE``), the Hub unreachable, or the upload refused.
    """
    from huggingface_hub import HfApi, constants

    parse_hub_name(HUB_PREFIX + repo_id)
    if constants.is_offline_mode():
        raise ValueError(f"push_to_hub={repo_id}: HF_HUB_OFFLINE is set; unset it, or upload {folder} later")
    api = HfApi(library_name="vitattn")
    try:
        url = api.create_repo(repo_id, repo_type="model", private=private, exist_ok=True)
        api.upload_folder(repo_id=repo_id, folder_path=folder, repo_type="model", commit_message="vitattn-export")
    except Exception as err:  # noqa: BLE001 - httpx and the Hub raise many types; the user gets one line
        raise ValueError(f"push_to_hub={repo_id}: {first_line(err)}; {folder} is written, upload it later") from None
    return str(url)
