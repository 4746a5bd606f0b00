"""Fake of TaskD's torch elastic-agent patch: importing it is the API; the fake records the import."""

from fake_record import record

record("taskd.python.adaptor.patch imported")
