"""The tool's own time: ``python -m autotune`` end to end by stage (``cli_time``) and the search's trials
per second beside a reference commit's (``search_speed``)."""
