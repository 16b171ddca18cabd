"""`localspec bench`'s engine room: workloads (the cases and prompt shape), runner (modes, timed
runs interleaved case by case), engine_run (one timed request, or modes in lockstep), peer
(llama-cpp-python's prompt lookup, the thing compared against), timing (the shared timing rules)
and report (rows, summaries, tables, plot).
"""

from .engine_run import run_engine, run_lockstep
from .peer import PEER_K, Peer
from .report import Row, first_difference, format_rows, format_summary, geomean, make_row, summarize
from .runner import Bench, BenchSettings, Mode, parse_modes
from .timing import Outcome, Ticker
from .workloads import DEFAULT_WORKLOADS, KINDS, Case, load_workloads, read_source

__all__ = ["DEFAULT_WORKLOADS", "KINDS", "PEER_K", "Bench", "BenchSettings", "Case", "Mode",
           "Outcome", "Peer", "Row", "Ticker", "first_difference", "format_rows",
           "format_summary", "geomean", "load_workloads", "make_row", "parse_modes",
           "read_source", "run_engine", "run_lockstep", "summarize"]
