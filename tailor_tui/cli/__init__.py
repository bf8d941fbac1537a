"""The headless front end: the command line (`main`), `--export` (`export`), the statistics report
(`health_report`).
"""
