"""The help formatter every ``heron`` subcommand uses: each option's default stated once."""

from __future__ import annotations

import argparse


class HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """Appends ``(default: X)`` to an option's help unless the help already states its
    default ("(default ..." or "default: ..." in it), the default is None (the help says what "not
    given" means), or the option is an on/off flag (its help says which way it turns)."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        lowered = text.lower()
        if not action.option_strings or "(default" in lowered or "default:" in lowered \
                or "%(default)" in text:
            return text
        if action.default is None or action.default is argparse.SUPPRESS:
            return text
        if isinstance(action.default, bool) or action.nargs == 0:
            return text
        return f"{text} (default: %(default)s)" if text else "(default: %(default)s)"
