"""What runs in the notebook: the magics and what they parse, a %%ddp cell's route (`run_cell`), reading a cell
(`cell_code`), the names that travel, export to a script, the planner, the doctor, recipes, a run's summary and
the dashboard. nbkit.launching starts the ranks; nbkit.live keeps a set of them across cells.
"""
