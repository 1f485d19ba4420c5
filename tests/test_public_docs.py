"""Every public name of the package, and every public method and property of its classes,
says what it does (help() is the reference an embedder reads first)."""

from __future__ import annotations

import inspect

import pushactors


def _undocumented() -> list[str]:
    missing = []
    for name in pushactors.__all__:
        if name.startswith("__"):
            continue
        obj = getattr(pushactors, name)
        if not inspect.getdoc(obj):
            missing.append(name)
        if not inspect.isclass(obj):
            continue
        for attr, value in vars(obj).items():
            if attr.startswith("_"):
                continue
            fn = value.fget if isinstance(value, property) else getattr(value, "__func__", value)
            if (inspect.isfunction(fn) or isinstance(value, property)) and not (fn.__doc__ or "").strip():
                missing.append(f"{name}.{attr}")
    return missing


def test_every_public_class_function_and_method_has_a_docstring() -> None:
    assert _undocumented() == []


def test_the_check_sees_a_missing_docstring(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    class Bare:
        """Documented class, undocumented method."""

        def run(self) -> None:
            pass

    monkeypatch.setattr(pushactors, "__all__", [*pushactors.__all__, "Bare"])
    monkeypatch.setattr(pushactors, "Bare", Bare, raising=False)
    assert _undocumented() == ["Bare.run"]
