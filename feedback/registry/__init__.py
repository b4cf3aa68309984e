"""The drafter registry on MLflow: drafter artifacts, registered versions per tenant, and SGLang's EAGLE3 export."""
