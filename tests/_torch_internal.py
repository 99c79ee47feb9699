"""Importing torch's internal test helpers (torch.testing._internal) without their side effects.

On import they change process-wide state: torch.backends flags frozen by disable_global_flags(),
and hypothesis' default profile swapped for torch's "dev" one with 10 examples.  Undone here, so
that the other test files of the session see what they expect
(tests/test_functional_contract_audit.py sets torch.backends.fp32_precision; tests/test_fuzz.py
sizes its own hypothesis budget).
"""
from __future__ import annotations

import importlib

import pytest


def import_torch_internal(name: str):
    """The module torch.testing._internal.<name>, with the state above restored; skips the
    calling test module where the installed torch lacks it."""
    import torch.backends as tb

    frozen = tb.flags_frozen()
    try:
        import hypothesis

        profile = getattr(hypothesis.settings, "_current_profile", None)
    except ImportError:
        hypothesis = profile = None
    try:
        module = importlib.import_module(f"torch.testing._internal.{name}")
    except ImportError as exc:
        pytest.skip(f"torch.testing._internal.{name} is not importable: {exc}", allow_module_level=True)
    finally:
        if not frozen:  # the flag disable_global_flags() cleared, in torch/backends/__init__.py
            tb.flags_frozen.__globals__["__allow_nonbracketed_mutation_flag"] = True
        if hypothesis is not None and profile is not None:
            hypothesis.settings.load_profile(profile)
    assert tb.flags_frozen() == frozen
    return module
