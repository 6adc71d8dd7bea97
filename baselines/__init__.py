"""The paper's baselines (§4.3, App. N) beside Text2Grad: scalar_rm (PPO's Bradley-Terry reward model and PRM-PPO's
process reward model: 02 --objective pairwise | prm, 03 --critic scalar-rm | prm), dpo (DPO), reflection (SFT +
reflection: 04 --reflect) and reflection_data (its revision data). A package, so that `from baselines import
scalar_rm` finds this folder and not an installed package of the same name."""
