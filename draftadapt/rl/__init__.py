"""The demo's RL run, for any world: GRPO playing "an existing RL run" with draftadapt attached
through its public API. ``loop`` is the recipe (setup, one RL step, the loop); ``grpo`` the policy
update; ``arms`` the measurements beside the run; ``summary`` its figures; ``config`` its settings;
``world`` what a world (the toy, a real model) gives the loop. Nothing here imports a world: the
``draftadapt demo`` command (draftadapt/demo.py) hands one in."""
