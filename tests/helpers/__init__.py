"""What the tests share that is not a fixture: ``from tests.helpers.NAME import ...``."""
