"""nbos.backends"""
