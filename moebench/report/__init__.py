"""Reports (tables, plots, HTML/Markdown/CSV) and the regression gate over results stores."""

from moebench.report.build import build_report

__all__ = ["build_report"]
