"""What the tests, the benchmarks and the demo share to run real Lightning jobs on CPU: the models and data
(``models``), the Trainer settings every job uses (``trainers``) and the launching and killing of a job's process tree
(``processes``). Not part of the installed package."""
