"""``rlmesh ray up`` / ``rlmesh ray down``: every service of a run as a Ray actor, each a thin
shell over ``rlmesh serve``. docs/ray.md"""
