"""Messages between processes, one module per channel, each message a dataclass defined once: `rank` (the bodies
every rank sends, on a forked rank's pipe or a live rank's relay), `live` (a live set's calls and what its ranks
add on the relay) and `spawn` (spawn mode's launcher and the notebook).
"""
