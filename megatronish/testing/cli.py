"""Running a command-line entry point or a ``tools/`` script in the test process, and checking
the contract every one of them keeps: an exit code and one line on stderr, never a traceback."""

from __future__ import annotations

import importlib.util
import traceback
from pathlib import Path
from types import ModuleType

TOOLS = Path(__file__).resolve().parents[2] / "tools"


def load_tool(name: str) -> ModuleType:
    """``tools/<name>.py`` as a module (the tools are scripts, not a package)."""
    spec = importlib.util.spec_from_file_location(f"tool_{name}", TOOLS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def run_main(main, argv, capfd) -> tuple[int, str, str]:
    """``(exit code, stdout, stderr)`` of ``main(argv)`` (``argv`` as strings); an argparse
    or ``sys.exit`` exit is caught. An exception ``main`` lets out ends it as it ends the
    program: exit 1 with the traceback on stderr (which :func:`assert_one_line` refuses).
    ``capfd``: pytest's fixture."""
    try:
        code = main(None if argv is None else [str(a) for a in argv])
    except SystemExit as e:
        code = e.code
    except Exception:
        traceback.print_exc()
        code = 1
    out, err = capfd.readouterr()
    return code, out, err


def assert_one_line(code, err: str, want_code: int, fragment: str) -> None:
    """Exit ``want_code`` with one line on stderr that holds ``fragment``, and no traceback."""
    assert "Traceback" not in err, err
    assert code == want_code, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and fragment in lines[0], err
