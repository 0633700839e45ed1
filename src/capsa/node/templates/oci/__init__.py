"""Templates from OCI images (issue 32), the first layer: an image reference pulled from its registry into a
local OCI layout and unpacked into a root filesystem, by maintained tools.

:mod:`.reference` parses and checks an image reference; :mod:`.pull` pulls it with skopeo (credentials in a
private auth file, a size limit checked from the manifest before the layers are fetched, a time limit);
:mod:`.config` reads the image's config from the layout (every blob checked against its digest);
:mod:`.unpack` unpacks the layers with umoci. Nothing here makes a guest root filesystem or a template yet.
"""

__all__: list[str] = []
