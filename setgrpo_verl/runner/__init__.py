"""The command line (``setgrpo-verl``) and its run directories.

* ``cli``       - argument parsing and the commands.
* ``run``       - a training command's plan from its flags, its data split, verl command lines and stages.
* ``launch``    - verl's ``main_ppo`` command line of each stage and the CPU backend's settings.
* ``stages``    - runs one stage as a supervised ``main_ppo`` process.
* ``datasplit`` - the calibration / train split, written as verl parquet files.
* ``preflight`` - the checks that run before verl starts.
* ``lifecycle`` - what each command does to each directory of a run (reuse, resume, replace).
* ``runlock``   - one command at a time per run directory.
* ``console``   - the progress line of a running stage.
* ``supervise`` - a stage's process group and Ray instance, stopped together.
* ``merge``     - calibration shards into one record.
* ``validate``  - the offline validation analysis of ``setgrpo-verl validate``.

Nothing outside this package imports it: the run directory's layout is :mod:`setgrpo_verl.rundir` and the embedded
model :mod:`setgrpo_verl.models`.
"""
