"""Finding, checking, describing, loading and downloading models."""

# The model path that names the embedded demo model, converted on first use: the
# loader, discovery (as the demo's source), the split check and the app's picker
# all use this one name.
DEMO = "demo"
