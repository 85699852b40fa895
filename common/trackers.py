"""Where a run's results go: the experiment trackers (W&B, TensorBoard) behind Accelerate (project and run
names, one W&B run per run folder across ``--resume``, credentials, images and weights artifacts), and the
Hugging Face hub (``--push_to_hub``: checked before anything is written, the model folder uploaded at the end).

``metrics.jsonl`` is written by :class:`common.run.Run` in every case; everything here is only for
``report_to`` = ``wandb`` or ``tensorboard`` and runs on the main process (Accelerate's trackers
are main-process objects).

- Project: ``cfg.project``, else ``WANDB_PROJECT``, else the recipe's name (its file name).
- Run name: ``cfg.run_name``, else ``WANDB_NAME``, else the run folder's name.
- The W&B run id is kept in the run folder (:data:`WANDB_ID_FILE`), so ``--resume auto`` continues
  the same W&B run instead of starting a second one.
- No credentials (checked through wandb's own login, for whatever host ``WANDB_BASE_URL`` names):
  W&B logs offline under the run folder, with one notice line.
"""

from __future__ import annotations

import contextlib
import io
import os
import secrets
import string
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
from PIL import Image

from common import UserError

if TYPE_CHECKING:
    from common.config import RunConfig

#: The W&B run id of a run folder, written when the run starts; ``--resume`` reads it back.
WANDB_ID_FILE = "wandb_run_id.txt"


def wandb_has_credentials() -> bool:
    """Whether wandb can log online without prompting: an API key in the environment, the netrc
    entry of the configured host (``WANDB_BASE_URL``: self-hosted servers too), or an explicit
    offline/disabled mode (nothing to authenticate). Never contacts the server."""
    if os.environ.get("WANDB_API_KEY") or os.environ.get("WANDB_MODE", "").lower() in ("offline", "disabled", "dryrun"):
        return True
    import wandb

    silent = os.environ.get("WANDB_SILENT")
    os.environ["WANDB_SILENT"] = "true"  # else login greets the user by name, which asks the server
    try:
        with contextlib.redirect_stderr(io.StringIO()), contextlib.redirect_stdout(io.StringIO()):
            return bool(wandb.login(prompt=False, verify=False))  # never prompts, never verifies online
    except TypeError:  # older wandb: no `prompt`; its api object reads the same sources
        return bool(getattr(getattr(wandb, "api", None), "api_key", None))
    except Exception:
        return False
    finally:
        if silent is None:
            os.environ.pop("WANDB_SILENT", None)
        else:
            os.environ["WANDB_SILENT"] = silent


def project_name(cfg: RunConfig, recipe: str) -> str:
    return cfg.project or os.environ.get("WANDB_PROJECT") or recipe


def run_name(cfg: RunConfig, run_dir: Path) -> str:
    return cfg.run_name or os.environ.get("WANDB_NAME") or run_dir.name


def init_trackers(
    accelerator: Any, cfg: RunConfig, recipe: str, run_dir: Path, config: Mapping[str, Any], say: Callable[[str], None]
) -> None:
    """Start ``cfg.report_to``'s tracker through Accelerate (every process calls this; Accelerate
    starts it on the main process). ``config`` goes to the tracker as the run's hyperparameters."""
    kwargs: dict[str, Any] = {}
    name = run_name(cfg, run_dir)
    if cfg.report_to == "wandb":
        kwargs["wandb"] = {"name": name, "dir": str(run_dir), "id": _wandb_id(run_dir, accelerator), "resume": "allow"}
        # silent: no banner of its own, no run summary at the end, no per-evaluation warnings; the start
        # banner names the tracker and where its files go, and every value is in metrics.jsonl
        kwargs["wandb"]["settings"] = {"silent": True}
        if accelerator.is_main_process and not wandb_has_credentials():
            # explicit: the credentials lookup already made wandb's settings, which read WANDB_MODE once
            os.environ["WANDB_MODE"] = kwargs["wandb"]["mode"] = "offline"
            say(
                "wandb: no credentials found (WANDB_API_KEY or `wandb login`), logging offline "
                f"under {run_dir}/wandb; upload later with `wandb sync`"
            )
    # Trackers such as tensorboard's hparams take only scalars: lists go as strings.
    flat = {k: (str(v) if isinstance(v, (list, dict)) else v) for k, v in config.items()}
    accelerator.init_trackers(project_name(cfg, recipe), config=flat, init_kwargs=kwargs)
    if cfg.report_to == "wandb" and accelerator.is_main_process and os.environ.get("WANDB_MODE") != "offline":
        url = getattr(accelerator.get_tracker("wandb", unwrap=True), "url", None)  # silent: wandb prints no link
        if url:
            say(f"wandb: {url}")


def _wandb_id(run_dir: Path, accelerator: Any) -> str:
    """The run folder's W&B id: read back on resume, else a new one written for the next resume."""
    path = run_dir / WANDB_ID_FILE
    saved = path.read_text().strip() if path.is_file() else ""
    if saved:
        return saved
    run_id = "".join(secrets.choice(string.ascii_lowercase + string.digits) for _ in range(8))  # W&B's id form
    if accelerator.is_main_process:
        path.write_text(run_id + "\n")
    return run_id


def log_images(accelerator: Any, report_to: str, images: Mapping[str, Image.Image], step: int) -> None:
    """PNG-like pictures to the tracker (main process): W&B images, TensorBoard image summaries."""
    if report_to == "none" or not images or not accelerator.is_main_process:
        return
    tracker = accelerator.get_tracker(report_to, unwrap=True)
    if report_to == "wandb":
        import wandb

        tracker.log({key: wandb.Image(image) for key, image in images.items()}, step=step)
    elif report_to == "tensorboard":
        for key, image in images.items():
            tracker.add_image(key, np.asarray(image.convert("RGB")), global_step=step, dataformats="HWC")


def log_table(accelerator: Any, report_to: str, key: str, rows: Sequence[Mapping[str, Any]], step: int) -> None:
    """A table (per-class values) to the tracker (main process): a W&B table, a TensorBoard text summary."""
    if report_to == "none" or not rows or not accelerator.is_main_process:
        return
    tracker, columns = accelerator.get_tracker(report_to, unwrap=True), list(rows[0])
    if report_to == "wandb":
        import wandb

        tracker.log({key: wandb.Table(columns=columns, data=[[r[c] for c in columns] for r in rows])}, step=step)
    elif report_to == "tensorboard":  # a markdown table
        lines = [" | ".join(columns), " | ".join("---" for _ in columns)]
        tracker.add_text(key, "\n".join(lines + [" | ".join(str(r[c]) for c in columns) for r in rows]), step)


def log_weights(accelerator: Any, report_to: str, paths: Sequence[Path], name: str) -> None:
    """Each weights file or model folder as a W&B model artifact ``<name>-<label>`` (main process, wandb
    only), the label being a safetensors file's stem (``best``), else its name with ``_`` for ``.``
    (``model``: the model folder, ``model_onnx``); offline runs upload them with ``wandb sync``."""
    if report_to != "wandb" or not accelerator.is_main_process:
        return
    import wandb

    tracker = accelerator.get_tracker("wandb", unwrap=True)
    for path in map(Path, paths):
        label = path.stem if path.suffix == ".safetensors" else path.name.replace(".", "_")
        artifact = wandb.Artifact(f"{name}-{label}".replace("/", "-"), type="model", metadata={"file": path.name})
        if path.is_dir():
            artifact.add_dir(str(path))
        else:
            artifact.add_file(str(path))
        tracker.log_artifact(artifact, aliases=["latest", label])


def check_hub_push(repo: str) -> None:
    """``--push_to_hub ORG/NAME``, checked before anything is written: the name's form, network allowed
    (``HF_HUB_OFFLINE`` unset) and a token where huggingface_hub looks (``HF_TOKEN``, ``hf auth login``);
    each a :class:`UserError` line, so that a long run does not find out at its end."""
    from huggingface_hub import get_token

    from common.models import hub_offline

    if not repo:
        return
    if repo.count("/") != 1 or not all(repo.split("/")):
        raise UserError(f"push_to_hub needs ORG/NAME (a hub model repository), got '{repo}'")
    if hub_offline():
        raise UserError(
            f"push_to_hub {repo}: HF_HUB_OFFLINE is set, so nothing can be uploaded; unset it or drop the flag"
        )
    if not get_token():
        raise UserError(
            f"push_to_hub {repo}: no Hugging Face token (set HF_TOKEN or run `hf auth login`); nothing was written"
        )


def push_folder(folder: Path, repo: str, api: Any = None) -> str:
    """Upload the model ``folder`` to the hub model repository ``repo`` (created if new; ``api``: a
    :class:`huggingface_hub.HfApi`, default a new one) and say where it went. A failed upload raises: the run
    (:meth:`common.run.Run.finish`) tells it in one line with the command that retries it, and the folder stays.
    No folder (the model folder failed, or the run writes none) is a line saying so: the model folder's own
    failure names the command that redoes it and the push."""
    if not Path(folder).is_dir():
        return f"push_to_hub: nothing to upload, {folder} was not written"
    if api is None:
        from huggingface_hub import HfApi

        api = HfApi()
    api.create_repo(repo, repo_type="model", exist_ok=True)
    info = api.upload_folder(folder_path=str(folder), repo_id=repo, repo_type="model", commit_message="cv-recipes")
    return f"push_to_hub: {folder} uploaded to {getattr(info, 'commit_url', None) or repo}"
