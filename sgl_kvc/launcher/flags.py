"""The user's SGLang flags, read with SGLang's own parser (`sglang_flags`), once per argument list,
for every decision the launcher takes from them; and `has_flag`, a literal look-up in the
launcher's own argument lists."""

from __future__ import annotations

import argparse
import functools
from dataclasses import dataclass
from typing import Any, Sequence


def has_flag(argv: list[str], flag: str) -> bool:
    """Whether `argv` sets `flag`, as `--flag`, `--flag VALUE` or `--flag=VALUE` (literally: the
    launcher's own argument lists; the user's SGLang flags are read by `sglang_flags`)."""
    return any(a == flag or a.startswith(flag + "=") for a in argv)


@dataclass(frozen=True)
class SGLangFlags:
    """The user's SGLang flags as SGLang's own parser reads them (`prepare_server_args`, before
    `ServerArgs` fills in what it derives): any spelling SGLang accepts (an alias, an abbreviation
    such as `--tp 2`, `--flag=VALUE`) and a `--config` YAML file's values, the command line over
    the file. Every decision the launcher takes from SGLang's flags reads them here, so that what
    it refuses or chooses is what SGLang will serve."""

    values: argparse.Namespace  # every flag's value (SGLang's parser default where not given)
    given: frozenset[str]  # the destinations set on the command line or in the --config file
    dests: dict[str, str]  # option string -> destination

    def get(self, flag: str) -> Any:
        """The value of `flag` (any of its option strings: `--tp-size`, `--tensor-parallel-size`)."""
        return getattr(self.values, self.dests[flag])

    def sets(self, flag: str) -> bool:
        """Whether the user gave `flag` (any spelling, on the command line or in its file)."""
        return self.dests[flag] in self.given


def sglang_flags(argv: Sequence[str]) -> SGLangFlags:
    """`SGLangFlags` of the SGLang flags `argv` (parsed once per argument list); a flag SGLang's
    parser refuses, or a bad `--config` file, is a usage error here, in one line."""
    return _parse_sglang_flags(tuple(argv))


@functools.lru_cache(maxsize=64)
def _parse_sglang_flags(argv: tuple[str, ...]) -> SGLangFlags:
    from sglang.srt.server_args import ServerArgs
    from sglang.srt.utils.server_args_config_parser import ConfigArgumentMerger

    # SGLang's own parser, as `prepare_server_args` builds it; no flag required (the launcher gives
    # the default model itself, `sglang_argv.build_sglang_argv`), and no usage dump before a one-line error.
    parser = argparse.ArgumentParser(prog="python -m sgl_kvc.launch", usage=argparse.SUPPRESS, add_help=False)
    ServerArgs.add_cli_args(parser)
    actions = [a for a in parser._actions if a.option_strings]  # argparse lists them nowhere public
    for action in actions:
        action.required = False
    args = list(argv)
    if "--config" in args:
        try:
            args = ConfigArgumentMerger(parser).merge_config_with_args(args)
        except (OSError, ValueError) as e:
            parser.error(f"--config: {e}")
    values = parser.parse_args(args)
    for action in actions:  # parsed again without defaults: what is left was given
        action.default = argparse.SUPPRESS
    given = frozenset(vars(parser.parse_args(args)))
    return SGLangFlags(values, given, {o: a.dest for a in actions for o in a.option_strings})
