"""levanter-tracker-csv: ``type: csv``, numeric metrics as a CSV table in the run directory.

An example third-party tracker plugin, written from ``docs/writing-a-tracker-plugin.md``.
"""

from levanter_tracker_csv.tracker import CsvTracker, CsvTrackerConfig

__all__ = ["CsvTracker", "CsvTrackerConfig"]
