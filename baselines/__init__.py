"""The paper's baselines (§4.3, App. N) beside Text2Grad: scalar_rm (PPO's Bradley-Terry reward model and PRM-PPO's
process reward model: 02 --objective pairwise | prm, 03 --critic scalar-rm | prm), dpo (DPO), reflection_data (SFT +
reflection's revision data; 04 --reflect). A package, so that `from baselines import scalar_rm` finds this folder and
not an installed package of the same name."""
