"""The ``%gpumem`` line magic and ``%%gpumem`` cell magic (``%load_ext gpukit``).

    %gpumem y = model(x)                 measure one statement
    %%gpumem --budget 4GB               run a cell as if on a 4 GB GPU
    %%gpumem --budget 4GB --host data   ... with the variable data in host memory (not counted on CPU)
    %%gpumem --label "adam step" --roles model,opt
    loss = model(x).sum(); loss.backward(); opt.step()

Each run displays a MemoryReport (HTML in Jupyter, text elsewhere) and appends it
to ``gpukit.history()``; ``gpukit.last()`` returns it.
"""

from __future__ import annotations

import ast
import contextlib
import io
import re
import shlex
import sys
import tokenize

import torch
from IPython.core import magic_arguments
from IPython.core.error import UsageError
from IPython.core.magic import Magics, line_cell_magic, magics_class, needs_local_scope
from IPython.display import display

from .budget import budget
from .meter import measure

# The magic's options, declared once: they build its argparse parser (and %gpumem?), and tell the line
# magic which options take a value, to find where the statement begins.
OPTIONS = (
    (("-l", "--label"), {"help": "name of this run in gpukit.history() (default: its first line)"}),
    (("-r", "--roles"), {"metavar": "MODEL[,OPTIMIZER]",
                         "help": "break memory down by role, for the model (and optimizer) variables named"}),
    (("-d", "--device"), {"help": "cpu, cuda or cuda:N (default: the GPU if there is one, else cpu)"}),
    (("-b", "--budget"), {"metavar": "SIZE",
                          "help": "run as if the device had only SIZE (4GB, 512MiB...): beyond it, OutOfMemoryError"}),
    (("--host",), {"metavar": "NAME[,NAME...]",
                   "help": "with --budget on CPU: variables a GPU run keeps in host memory (a dataset), not counted"}),
    (("-q", "--quiet"), {"action": "store_true", "help": "record the run, display nothing"}),
)
_VALUE_OPTIONS = {flag for flags, spec in OPTIONS if "action" not in spec for flag in flags}


def _with_options(function):
    """IPython's ``magic_arguments`` decorators, one per entry of ``OPTIONS``, in their order."""
    for flags, spec in reversed(OPTIONS):  # decorators apply from the bottom up
        function = magic_arguments.argument(*flags, **spec)(function)
    return magic_arguments.magic_arguments()(function)


def _take_token(text: str) -> tuple[str, str]:
    """Split the first shell-like token (quotes allowed) off ``text``."""
    if text[0] in "'\"":
        end = text.find(text[0], 1)
        if end < 0:
            raise UsageError(f"unclosed quote in: {text}")
        return text[1:end], text[end + 1:].lstrip()
    match = re.match(r"\S+", text)
    return match.group(), text[match.end():].lstrip()


def split_line(line: str) -> tuple[list[str], str]:
    """``'-l big y = f(x)'`` -> ``(['-l', 'big'], 'y = f(x)')``; a ``--`` ends the options."""
    rest, flags = line.strip(), []
    while rest.startswith("-"):
        token, rest = _take_token(rest)
        if token == "--":
            break
        flags.append(token)
        if token in _VALUE_OPTIONS:
            if not rest:
                raise UsageError(f"option {token} needs a value")
            value, rest = _take_token(rest)
            flags.append(value)
    return flags, rest


def _join_values(flags: list[str]) -> list[str]:
    """``['--budget', '-1GB']`` -> ``['--budget=-1GB']``: a value that starts with '-' stays a value
    (argparse would take it for an option), so that it is checked, and refused, as a value."""
    out, i = [], 0
    while i < len(flags):
        token = flags[i]
        if token in _VALUE_OPTIONS and i + 1 < len(flags) and flags[i + 1].startswith("-"):
            out.append(f"{token}={flags[i + 1]}" if token.startswith("--") else token + flags[i + 1])
            i += 2
        else:
            out.append(token)
            i += 1
    return out


def _default_label(code: str) -> str:
    first = next((ln.strip() for ln in code.splitlines() if ln.strip() and not ln.strip().startswith("#")), "")
    return first if len(first) <= 40 else first[:39] + "…"


def _ends_with_semicolon(source: str) -> bool:
    """Whether the cell's last token, comments and line ends aside, is ';': IPython then shows no value.
    IPython 8's ``DisplayHook.semicolon_at_end_of_expression``, the same rule; IPython 7 (Colab's) has none."""
    skip = (tokenize.ENDMARKER, tokenize.NL, tokenize.NEWLINE, tokenize.COMMENT)
    tokens = tokenize.generate_tokens(io.StringIO(source).readline)
    last = next((t for t in reversed(list(tokens)) if t.type not in skip), None)
    return last is not None and last.type == tokenize.OP and last.string == ";"


@magics_class
class GpuMemMagics(Magics):
    """Registers ``%gpumem`` / ``%%gpumem``."""

    @_with_options
    @needs_local_scope
    @line_cell_magic
    def gpumem(self, line: str, cell: str | None = None, local_ns: dict | None = None):
        """Run code and show the memory it used (peak, delta, live) on the GPU, or on CPU without one.

        Line:  %gpumem [options] STATEMENT      (put -- before a statement that starts with '-')
        Cell:  %%gpumem [options]  on the first line of a cell
        """
        __tracebackhide__ = True  # an error in the cell shows the cell's line, not the magic's frames
        try:
            if cell is None:
                flags, code = split_line(line)
                if not code.strip():
                    raise UsageError("no statement to measure: %gpumem [options] STATEMENT")
                args = self.gpumem.parser.parse_args(_join_values(flags))
            else:
                args = self.gpumem.parser.parse_args(_join_values(shlex.split(line)))
                code = cell
            # Look names up in place: a copy of the namespace would keep every old
            # value alive through the block and hide the frees the cell makes.
            scopes = [self.shell.user_ns] if local_ns is None else [local_ns, self.shell.user_ns]
            meter = measure(args.device, label=args.label or _default_label(code),
                            **self._roles(args.roles, scopes))
            if args.host is not None and args.budget is None:
                raise UsageError("--host names what a --budget leaves out; give a --budget too")
            cap = (budget(args.budget, args.device, host=self._variables(args.host, scopes))
                   if args.budget is not None else contextlib.nullcontext())
        except (UsageError, ValueError) as err:
            options = self.gpumem.parser.format_usage().replace("::", "").strip().removeprefix("%gpumem ")
            print(f"usage: %gpumem {options} STATEMENT\n   or: %%gpumem {options}   (first line of a cell)\n"
                  f"%gpumem: error: {err}\n(nothing was run; see %gpumem? for every option)", file=sys.stderr)
            return None

        with meter as report, cap:
            value = self._run(code, local_ns)
        if not args.quiet:
            display(report)
        return value

    @staticmethod
    def _variables(spec: str | None, scopes: list[dict]) -> list | None:
        if spec is None:
            return None
        found = []
        for name in (n.strip() for n in spec.split(",")):
            scope = next((ns for ns in scopes if name in ns), None)
            if scope is None:
                raise UsageError(f"--host: no variable named {name!r}")
            found.append(scope[name])
        return found

    @staticmethod
    def _roles(spec: str | None, scopes: list[dict]) -> dict:
        if not spec:
            return {}
        names = [n.strip() for n in spec.split(",")]
        if len(names) > 2 or not all(names):
            raise UsageError(f"--roles takes MODEL or MODEL,OPTIMIZER, got {spec!r}")
        found = []
        for name, kind in zip(names, (torch.nn.Module, torch.optim.Optimizer)):
            scope = next((ns for ns in scopes if name in ns), None)
            if scope is None:
                raise UsageError(f"--roles: no variable named {name!r}")
            if not isinstance(scope[name], kind):
                raise UsageError(f"--roles: {name!r} is a {type(scope[name]).__name__}, not a {kind.__name__}")
            found.append(scope[name])
        return {"model": found[0], "optimizer": found[1] if len(found) > 1 else None}

    def _run(self, code: str, local_ns: dict | None):
        """Run ``code`` as IPython would; return the value of a final expression."""
        __tracebackhide__ = True
        shell = self.shell
        source = shell.transform_cell(code)
        # Registered with IPython's line cache, so that a traceback shows the cell's failing line.
        filename = shell.compile.cache(source, shell.execution_count, raw_code=code)
        tree = shell.transform_ast(shell.compile.ast_parse(source, filename))
        last = None
        if tree.body and isinstance(tree.body[-1], ast.Expr):
            last = ast.Expression(tree.body.pop().value)
        glob = shell.user_ns
        local = glob if local_ns is None else local_ns
        exec(shell.compile(tree, filename, "exec"), glob, local)
        if last is not None:
            value = eval(shell.compile(last, filename, "eval"), glob, local)
            # A trailing ';' hides the value, as in a plain cell.
            return None if _ends_with_semicolon(source) else value
        return None
