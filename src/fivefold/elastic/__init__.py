"""elastic"""
