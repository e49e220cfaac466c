"""The tests' shared helpers: one package, imported as ``helpers.NAME`` (pyproject puts tests/ on the path).

- :mod:`.cli_process`       ``gpipe-plan`` in a child process, as a user runs it
- :mod:`.planner`           random planner instances, profile documents, an independent reference model
- :mod:`.handplan`          a plan written by hand for a chosen split (also the benchmarks' helper)
- :mod:`.plan_docs`         plan documents of other versions and layouts
- :mod:`.rank_pool`         groups of ranks started once per session and reused
- :mod:`.ranks`             training on ranks: the unsplit reference, comparing parameters, many runs in one group
- :mod:`.user_models`       the source of the user model the tests share
- :mod:`.torchtitan_config` the record of torchtitan's config classes
- ``user_modules/``         modules the tests name as a user does (``hf_models:make_gpt2``): that
                            folder is on the path too (pyproject), so they import by their own name
"""
