"""Settings, the error hierarchy and small shared helpers; imports nothing else from visionloop."""
