"""The torchrun-style launcher (``neuronmp-run``) and torchelastic's error-file protocol.

    launcher.py   plan each rank's slice of cores, spawn, watch, stop in stages
                  (supervise.stop_in_stages), restart the group, summarise the root cause
    errorfile.py  ``record``: a rank's uncaught exception written to
                  TORCHELASTIC_ERROR_FILE as torchelastic does, read back for the summary

Imports no torch: ranks import it themselves.
"""
