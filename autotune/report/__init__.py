"""The output directory: report.md and report.html, the figures (one function per PNG), tables and the plan."""

from autotune.report.plots import memory_by_original_level
from autotune.report.writer import markdown_table, write_report

__all__ = ["markdown_table", "memory_by_original_level", "write_report"]
