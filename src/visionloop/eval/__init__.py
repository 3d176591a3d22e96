"""Evaluation beyond one accuracy number: stress under seeded image corruptions at five
severities (`corruptions`), calibration of a classifier's confidences and temperature
scaling (`calibration`); slices, error types and the promotion gate build on them.

Pure library code: no CLI, no tracking, no state on disk except the files a caller asks for.
"""
