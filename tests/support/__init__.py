"""Helpers shared by the tests (not tests themselves): imported as ``support.<module>``."""
