"""draft_service"""
