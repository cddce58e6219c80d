"""The optional extras: what names the pip command when one is missing."""

from __future__ import annotations

from .errors import BadInput

HF_EXTRA = "pip install 'nsa_titan[hf]'   (from a checkout: pip install -e '.[hf]')"


class MissingExtra(BadInput):
    """An optional extra is not installed (bad input: one line, exit 2)."""

    kind = "config"


def require_hf(what: str) -> None:
    """Raise MissingExtra, naming the pip command, when transformers cannot be imported."""
    try:
        import transformers  # noqa: F401
    except ImportError:
        raise MissingExtra(f"{what} needs transformers, which is not installed: {HF_EXTRA}") from None


WANDB_EXTRA = "pip install 'nsa_titan[wandb]'   (from a checkout: pip install -e '.[wandb]')"


def require_wandb(what: str) -> None:
    """Raise MissingExtra, naming the pip command, when wandb cannot be imported."""
    try:
        import wandb  # noqa: F401
    except ImportError:
        raise MissingExtra(f"{what} needs wandb, which is not installed: {WANDB_EXTRA}") from None


def require_lm_eval(what: str) -> None:
    """Raise MissingExtra, naming the pip command, when lm-evaluation-harness cannot be imported."""
    try:
        import lm_eval  # noqa: F401
    except ImportError:
        raise MissingExtra(f"{what} need lm-eval, which is not installed: {HF_EXTRA}") from None
