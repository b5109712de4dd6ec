"""Starting and watching ranks, run in the notebook (or spawn's launcher): how ranks are set up (`RankOptions`),
forking them (`fork`: nbkit.launch), spawning fresh processes (`spawn`), how a rank ended (`supervisor`), and
what the notebook and its ranks agree on (`rank_contract`: how many, their environment, the value's way back).
"""
