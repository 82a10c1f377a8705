"""verl's RL dataset with rubric validation at load time.

:class:`RubricRLHFDataset` is verl's ``RLHFDataset`` that, once its files are read (and ``max_samples`` /
overlong-prompt filtering applied), validates every row's ``reward_model.ground_truth`` with
:meth:`setgrpo_verl.grading.Rubric.from_row` -- the same validator as the converters, ``--data`` and the reward
manager. A malformed rubric (null or non-numeric points, null or blank criterion text, a rule id unknown to
if-verifiable, ...) then stops the run when the trainer builds its datasets, before any worker or model starts,
naming the file, the row number, the row id, the criterion index and the field.

Select it through verl's own hook for dataset classes::

    data.custom_cls.path=pkg://setgrpo_verl.grading.verl_dataset data.custom_cls.name=RubricRLHFDataset

Importing this module imports verl.
"""

from __future__ import annotations

from verl.utils.dataset.rl_dataset import RLHFDataset

from .convert import validate_verl_rows

__all__ = ["RubricRLHFDataset"]


class RubricRLHFDataset(RLHFDataset):
    """``RLHFDataset`` whose rows must carry a valid rubric in ``reward_model.ground_truth``.

    Same constructor and items as :class:`verl.utils.dataset.rl_dataset.RLHFDataset`.

    Raises:
        setgrpo_verl.grading.RubricRowError: (a ``ValueError``, at construction) the first row whose rubric does not
            validate; its location is ``"<data files>, row <n>"`` (1-based, after verl's sampling and filtering).
    """

    def _read_files_and_tokenize(self):
        super()._read_files_and_tokenize()
        columns = [c for c in ("reward_model", "extra_info") if c in self.dataframe.column_names]
        source = ", ".join(str(f) for f in self.original_data_files)
        validate_verl_rows(self.dataframe.select_columns(columns), source=source)
