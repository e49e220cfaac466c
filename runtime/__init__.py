"""The runtime: train with a plan, one process per stage, and measure it against the prediction.

``gpipe-plan run plan.json`` (:mod:`.command`) starts K ranks (:mod:`.launch`), or is one
rank under ``torchrun``. Each rank (:mod:`.train`):

1. builds the model from the plan's spec and the seed on the meta device, making real only
   its stage's chunks (:mod:`gpipe_plan.models.materialize`, :mod:`.stage`), and loads their
   part of ``--init-from`` weights (:mod:`.init_from`);
2. runs its stage's list of the schedule's actions every step (``gpipe_plan.schedules``,
   :mod:`.executor`), sending activations forward and gradients back to the stages holding
   the neighbouring chunks (:mod:`.p2p`);
3. steps its optimizer, saves checkpoints (:mod:`.checkpoint`; the folder, whose run each step
   belongs to and who may write it: :mod:`.checkpoint_dir`), records spans (:mod:`.timing`),
   and stops with one line if it makes no progress for ``--timeout`` (:mod:`.watchdog`);
4. at the end, sends what it measured to rank 0, which writes the report (:mod:`.report`),
   the trace (:mod:`.trace`) and the saved model.

``gpipe-plan demo`` (:mod:`gpipe_plan.demo`) runs profile -> solve -> run on the built-in gpt.

Importing this package stays cheap (no torch): ``gpipe-plan --help`` imports the CLI only.
"""
