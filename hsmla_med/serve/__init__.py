"""``hsmla-med serve``: a DICOM node that a PACS sends image series to and that sends DICOM SEG
results back.

The parts, in the order an image goes through them: :mod:`.config` (the node's YAML), :mod:`.spool`
(the C-STORE handler: each instance checked and written to ``spool/<Study>/<Series>/<SOP>.dcm``;
a series that stopped growing is moved into a job's folder), :mod:`.routing` (which model takes a
series, by its attributes), :mod:`.queue` (the durable job queue, SQLite in WAL mode),
:mod:`.worker` (one job: the task's prediction on the series, then the sending), :mod:`.report`
and :mod:`.capture` (a route's structured report of the volumes, and its burned-in series),
:mod:`.send` (C-STORE or STOW-RS to each destination, with retries) and :mod:`.node` (the
association handling, the scheduler and the workers, started and stopped together).

:mod:`.dicomweb` serves ``infer --input dicomweb:URL --study UID`` (one study pulled by QIDO-RS
and WADO-RS) and ``infer --send`` (its destinations, sent through :mod:`.send`).

Nothing here is imported by ``hsmla-med --help``: pynetdicom, torch and the pipelines load when
the node starts.
"""
