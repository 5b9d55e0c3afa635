"""Where the opt-in stand-ins for Mooncake's and NIXL's Python packages are.

The kvmove wheel carries them as plain directories next to the ``kvmove``
package (``mooncake-shim/``, ``nixl-shim/``), which nothing imports until a
directory is put on ``PYTHONPATH``; in a source checkout they are
``python/mooncake-shim`` and ``python/nixl-shim``. Then an unmodified
``from mooncake.engine import TransferEngine`` or ``from nixl._api import
nixl_agent`` gets kvmove's classes::

    PYTHONPATH=$(python -m kvmove.shims nixl) vllm serve ...
    PYTHONPATH=$(python -m kvmove.shims mooncake) python -m sglang.launch_server ...
"""

import sys
from pathlib import Path

#: The stand-in packages by the name of the package they replace.
SHIMS = {"mooncake": "mooncake-shim", "nixl": "nixl-shim"}


def path(name: str) -> str:
    """The directory to put on ``PYTHONPATH`` for the stand-in of
    ``name`` (``"mooncake"`` or ``"nixl"``)."""
    if name not in SHIMS:
        raise ValueError(f"no stand-in for {name!r}; there are: {', '.join(SHIMS)}")
    d = Path(__file__).resolve().parent.parent / SHIMS[name]
    if not (d / name / "__init__.py").is_file():
        raise FileNotFoundError(f"the {name} stand-in is missing: {d} (reinstall kvmove)")
    return str(d)


def main(argv=None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1 or args[0] not in SHIMS:
        print(f"usage: python -m kvmove.shims {{{'|'.join(SHIMS)}}}", file=sys.stderr)
        return 2
    print(path(args[0]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
