"""The plugin module named by the ``levanter`` entry point: registers ``type: csv``."""

from levanter_core.plugins import hookimpl


@hookimpl
def register_trackers(register):
    from levanter_tracker_csv.tracker import CsvTrackerConfig

    register("csv", CsvTrackerConfig)
