"""target_service"""
