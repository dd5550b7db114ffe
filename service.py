"""``bentoml serve service:CapsuleService`` from the repository root (and the bentofiles' ``service:``): the service
itself lives in the package, ``capserve.serving.service``, so that an installed capserve can serve it too."""

from capserve.serving.service import CapsuleService

__all__ = ["CapsuleService"]
