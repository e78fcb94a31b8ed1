"""The `ctl` file's text commands: parsing and validation, then dispatch to the service.

A write holds one command per line. Every line is parsed and validated first, each into an
action; only when all of them are valid are the actions applied, in order. So a bad line
fails the whole write with EINVAL and changes nothing. A write must also arrive whole: one
larger than CTL_MAX_WRITE fails with EFBIG (files.py), because the kernel splits writes
that exceed FUSE's max_write and each part would otherwise be applied on its own.

Numbers are ASCII only: Python's int() and float() accept any Unicode digit (`٣` is 3),
which no operator means to type.
"""

from __future__ import annotations

import logging
import math
import re
from collections.abc import Awaitable, Callable

from shadefs.common import format_size, parse_size
from shadefs.control.entries import NAME
from shadefs.control.service import ControlService, Rejected

log = logging.getLogger(__name__)

# The largest ctl write accepted (bytes). It is below FUSE's smallest max_write (128 KiB), so
# any write up to it reaches the daemon as one request, and is applied whole or not at all.
CTL_MAX_WRITE = 1 << 16
LOG_LEVELS = ("debug", "info", "warning", "error")

HELP = """\
# shadefs control file: write one command per line, e.g.  echo 'ram 8G' > ctl
# A bad line fails the whole write with EINVAL and changes nothing.
# One write may hold at most {max_write} bytes: a larger one fails whole with EFBIG.
policy NAME          switch the eviction policy ({policies})
ram SIZE             set the RAM budget (bytes or K/M/G/T suffix); shrinking evicts at once
ssd SIZE             set the SSD budget (needs --ssd)
drop                 drop every cached file from RAM (the SSD tier is kept)
evict PATH...        drop these files (relative to the mount root) from every tier
prefetch PATH...     fetch these files ahead, in this order (a small plan)
plan-drop NAME|all   forget prefetch plans (names in stats.json, prefetch.plan_positions)
epoch N              the writing job starts epoch N
job NAME [group=G]   name the writing process's job (stats.json `jobs`); G: its sweep group
report [epoch=N] [train_loss=X] [val_accuracy=Y]
                     end-of-epoch progress (adapts the replay factor)
replay R|auto        fix the replay factor r (>= 1) or let the daemon adapt it
log-level LEVEL      set the daemon's log level ({levels})
"""

_INT = re.compile(r"[+-]?[0-9]+")
_FLOAT = re.compile(r"[+-]?(?:[0-9]+(?:\.[0-9]*)?|\.[0-9]+)(?:[eE][+-]?[0-9]+)?")

Action = Callable[[], Awaitable[str]]


class CommandError(ValueError):
    """A control command that cannot be accepted; the message says why."""


def help_text(service: ControlService, last_result: str) -> str:
    """What reading `ctl` shows: the commands, then the result of the last write."""
    text = HELP.format(
        max_write=CTL_MAX_WRITE,
        policies=", ".join(service.policy_names),
        levels=", ".join(LOG_LEVELS),
    )
    return text + f"# last write: {last_result}\n"


async def execute(service: ControlService, buf: bytes, pid: int = 0) -> str:
    """Validate every line of `buf`, then apply them all (or none: CommandError).

    `pid` is the writing process: `epoch` and `job` apply to its job. Returns what the
    write did, for the ctl file's last line.
    """
    try:
        text = buf.decode("utf-8")
    except UnicodeDecodeError:
        raise CommandError("commands must be UTF-8 text") from None
    actions: list[tuple[str, Action]] = []
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        actions.append((line, await _parse(service, line, pid)))
    if not actions:
        raise CommandError("no command given")
    results = [f"{line}: {await apply()}" for line, apply in actions]
    return "ok: " + "; ".join(results)


async def _parse(service: ControlService, line: str, pid: int) -> Action:
    words = line.split()
    cmd, args = words[0], words[1:]
    if cmd in _JOB_PARSERS:
        return await _JOB_PARSERS[cmd](service, args, pid)
    parser = _PARSERS.get(cmd)
    if parser is None:
        raise CommandError(f"unknown command {cmd!r} (read the ctl file for the list)")
    return await parser(service, args)


# --- one parser per command: validate now, return what applies it -------------------------


async def _policy(service: ControlService, args: list[str]) -> Action:
    _nargs("policy", args, 1)
    name = args[0]
    if name not in service.policy_names:
        choices = ", ".join(service.policy_names)
        raise CommandError(f"unknown policy {name!r} (choose from {choices})")

    async def apply() -> str:
        service.set_policy(name)
        return f"policy is {name}"

    return apply


async def _ram(service: ControlService, args: list[str]) -> Action:
    _nargs("ram", args, 1)
    size = _size(args[0])

    async def apply() -> str:
        service.set_ram(size)
        return f"ram budget {format_size(size)}"

    return apply


async def _ssd(service: ControlService, args: list[str]) -> Action:
    _nargs("ssd", args, 1)
    size = _size(args[0])
    if not service.has_ssd:
        raise CommandError("no SSD tier: mount with --ssd DIR[:SIZE]")

    async def apply() -> str:
        await service.set_ssd(size)
        return f"ssd budget {format_size(size)}"

    return apply


async def _drop(service: ControlService, args: list[str]) -> Action:
    _nargs("drop", args, 0)

    async def apply() -> str:
        return f"dropped {service.drop_ram()} files"

    return apply


async def _evict(service: ControlService, args: list[str]) -> Action:
    if not args:
        raise CommandError("evict takes one or more paths")
    rels = [relpath(a.encode()) for a in args]
    try:
        keys, _ = await service.resolve_files(rels)
    except Rejected as exc:
        raise CommandError(f"evict: {exc}") from None

    async def apply() -> str:
        return f"evicted {await service.evict(keys)} of {len(keys)} files"

    return apply


async def _prefetch(service: ControlService, args: list[str]) -> Action:
    if not args:
        raise CommandError("prefetch takes one or more paths")
    _need_prefetching(service)
    rels = [relpath(a.encode()) for a in args]
    try:
        keys, sizes = await service.resolve_files(rels)
    except Rejected as exc:
        raise CommandError(f"prefetch: {exc}") from None

    async def apply() -> str:
        service.prefetch(rels, keys, sizes)
        return f"prefetching {len(rels)} files"

    return apply


async def _plan_drop(service: ControlService, args: list[str]) -> Action:
    _nargs("plan-drop", args, 1)
    _need_prefetching(service)
    known = service.plan_names()
    if args[0] != "all" and args[0] not in known:
        raise CommandError(f"no plan named {args[0]!r}")
    names = known if args[0] == "all" else [args[0]]

    async def apply() -> str:
        return f"dropped {service.drop_plans(names)} plans"

    return apply


async def _epoch(service: ControlService, args: list[str], pid: int) -> Action:
    _nargs("epoch", args, 1)
    epoch = parse_int(args[0], "epoch")

    async def apply() -> str:
        service.begin_epoch(epoch, pid)
        return f"epoch {epoch}"

    return apply


_JOB_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.:/@+-]{0,127}")


async def _job(service: ControlService, args: list[str], pid: int) -> Action:
    if not 1 <= len(args) <= 2:
        raise CommandError("job takes a name and optionally group=NAME")
    name, group = args[0], ""
    if len(args) == 2:
        key, sep, group = args[1].partition("=")
        if key != "group" or not sep:
            raise CommandError(f"job: bad argument {args[1]!r} (group=NAME)")
    for what, value in (("name", name), ("group", group)):
        if value and not _JOB_NAME.fullmatch(value):
            raise CommandError(f"job: bad {what} {value!r} (letters, digits, _.:/@+-)")
    if not pid:
        raise CommandError("job: the writing process is unknown")

    async def apply() -> str:
        service.name_job(pid, name, group)
        return f"job {name}" + (f" in group {group}" if group else "")

    return apply


async def _report(service: ControlService, args: list[str], pid: int) -> Action:
    values: dict[str, float] = {}
    for arg in args:
        key, sep, value = arg.partition("=")
        if not sep or key not in ("epoch", "train_loss", "val_accuracy") or key in values:
            raise CommandError(f"report: bad argument {arg!r}")
        values[key] = parse_int(value, key) if key == "epoch" else parse_float(value, key)
    epoch = values.get("epoch")

    async def apply() -> str:
        return service.report(
            None if epoch is None else int(epoch),
            values.get("train_loss"),
            values.get("val_accuracy"),
            pid,
        )

    return apply


async def _replay(service: ControlService, args: list[str]) -> Action:
    _nargs("replay", args, 1)
    value = None if args[0] == "auto" else parse_float(args[0], "replay")
    if value is not None and not 1.0 <= value <= 64.0:
        raise CommandError("replay must be between 1 and 64, or auto")

    async def apply() -> str:
        service.set_replay(value)
        return f"replay {'auto' if value is None else value}"

    return apply


async def _log_level(service: ControlService, args: list[str]) -> Action:
    _nargs("log-level", args, 1)
    level = args[0].lower()
    if level not in LOG_LEVELS:
        raise CommandError(f"unknown log level {args[0]!r}")

    async def apply() -> str:
        service.set_log_level(level)
        return f"log level {level}"

    return apply


_PARSERS: dict[str, Callable[[ControlService, list[str]], Awaitable[Action]]] = {
    "policy": _policy,
    "ram": _ram,
    "ssd": _ssd,
    "drop": _drop,
    "evict": _evict,
    "prefetch": _prefetch,
    "plan-drop": _plan_drop,
    "replay": _replay,
    "log-level": _log_level,
}


# Commands that apply to the writing process's job.
_JOB_PARSERS: dict[str, Callable[[ControlService, list[str], int], Awaitable[Action]]] = {
    "epoch": _epoch,
    "report": _report,
    "job": _job,
}


# --- validation shared with the other control files -----------------------------------------


def relpath(raw: bytes) -> bytes:
    """A path relative to the mount root, refusing anything that could leave it."""
    parts = raw.split(b"/")
    if (
        not raw
        or b"\0" in raw
        or any(part in (b"", b".", b"..") for part in parts)
        or parts[0] == NAME
    ):
        raise CommandError(f"{raw!r} is not a path relative to the mount root")
    return raw


def parse_int(text: str, what: str) -> int:
    """A non-negative integer in ASCII digits, below 2**62."""
    if not _INT.fullmatch(text):
        raise CommandError(f"{what} must be an integer, got {text!r}")
    value = int(text)
    if not 0 <= value < 1 << 62:
        raise CommandError(f"{what} out of range")
    return value


def parse_float(text: str, what: str) -> float:
    """A finite decimal number in ASCII digits (no inf, nan or digit separators)."""
    if not _FLOAT.fullmatch(text):
        raise CommandError(f"{what} must be a number, got {text!r}")
    value = float(text)
    if not math.isfinite(value):
        raise CommandError(f"{what} must be finite")
    return value


def _size(text: str) -> int:
    try:  # ASCII digits only, like every number here
        return parse_size(text)
    except ValueError as exc:
        raise CommandError(str(exc)) from None


def _nargs(cmd: str, args: list[str], n: int) -> None:
    if len(args) != n:
        raise CommandError(f"{cmd} takes {n} argument{'s' if n != 1 else ''}, got {len(args)}")


def _need_prefetching(service: ControlService) -> None:
    if not service.prefetching:
        raise CommandError("prefetching is off (mounted with --no-prefetch)")
