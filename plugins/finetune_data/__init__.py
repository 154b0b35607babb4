"""The data set prepared for a run (`prepare`): read, encoded with the contract's one encoding,
packed, split and written as Arrow files, by the prepare_data stage on the Airflow worker and
loaded by the trainer. Unlike the contract it needs `datasets` and `transformers` (imported on
use); both sides ship it (the trainer image copies it beside trainer/).
"""
