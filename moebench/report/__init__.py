"""Reports (tables, plots, HTML/Markdown/CSV) and the regression gate over results stores.

Imports nothing itself, so commands that only register report subcommands stay light.
"""
