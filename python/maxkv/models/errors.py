"""The error a model that cannot be loaded raises."""


class ModelLoadError(ValueError):
    """A model that cannot be loaded: missing or corrupt file, unsupported
    architecture, feature or tensor type, or a weight of the wrong shape."""
