"""Actor-critic (REINFORCE with a learned baseline): a two-headed policy, a `Categorical` over
actions, saved (log_prob, value) pairs and rewards kept in Python lists on the module,
discounted returns computed in a Python loop, normalized returns, smooth-L1 value loss, and a
running reward updated with `.item()`-free Python floats. A tiny pole-balancing environment in
plain Python replaces gym."""
import math
import random
import sys
from collections import namedtuple

import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.optim as optim
from torch.distributions import Categorical

SavedAction = namedtuple("SavedAction", ["log_prob", "value"])
eps = 1e-6


class PoleEnv:
    """Cart-pole-like dynamics: push left or right, the episode ends when the pole falls."""

    def __init__(self, rng, max_steps=12):
        self.rng, self.max_steps = rng, max_steps

    def reset(self):
        self.t = 0
        self.state = [self.rng.uniform(-0.05, 0.05) for _ in range(4)]
        return list(self.state)

    def step(self, action):
        x, x_dot, theta, theta_dot = self.state
        force = 1.0 if action == 1 else -1.0
        theta_acc = 9.8 * math.sin(theta) - force * math.cos(theta) * 0.5
        x_dot += 0.02 * force
        theta_dot += 0.05 * theta_acc
        x += 0.02 * x_dot
        theta += 0.05 * theta_dot
        self.state = [x, x_dot, theta, theta_dot]
        self.t += 1
        done = abs(theta) > 0.2 or abs(x) > 2.4 or self.t >= self.max_steps
        return list(self.state), 1.0, done


class Policy(nn.Module):
    def __init__(self):
        super().__init__()
        self.affine1 = nn.Linear(4, 32)
        self.action_head = nn.Linear(32, 2)
        self.value_head = nn.Linear(32, 1)
        self.saved_actions = []
        self.rewards = []

    def forward(self, x):
        x = F.relu(self.affine1(x))
        action_prob = F.softmax(self.action_head(x), dim=-1)
        state_values = self.value_head(x)
        return action_prob, state_values


def main(steps=8, optimize=lambda obj: obj, gamma=0.99):
    torch.manual_seed(543)
    env = PoleEnv(random.Random(543))
    model = optimize(Policy())
    optimizer = optim.Adam(model.parameters(), lr=3e-2)

    def select_action(state):
        state = torch.tensor(state, dtype=torch.float32)
        probs, state_value = model(state)
        m = Categorical(probs)
        action = m.sample()
        model.saved_actions.append(SavedAction(m.log_prob(action), state_value))
        return action.item()

    def finish_episode():
        R = 0
        saved_actions = model.saved_actions
        policy_losses, value_losses, returns = [], [], []
        for r in model.rewards[::-1]:
            R = r + gamma * R
            returns.insert(0, R)
        returns = torch.tensor(returns)
        returns = (returns - returns.mean()) / (returns.std() + eps)
        for (log_prob, value), R in zip(saved_actions, returns):
            advantage = R - value.item()
            policy_losses.append(-log_prob * advantage)
            value_losses.append(F.smooth_l1_loss(value, torch.tensor([R])))
        optimizer.zero_grad()
        loss = torch.stack(policy_losses).sum() + torch.stack(value_losses).sum()
        loss.backward()
        optimizer.step()
        del model.rewards[:]
        del model.saved_actions[:]
        return loss.item()

    select_action, finish_episode = optimize(select_action), optimize(finish_episode)
    running_reward, losses, lengths = 10, [], []
    for i_episode in range(steps):
        state, ep_reward = env.reset(), 0
        for t in range(1, 10000):
            action = select_action(state)
            state, reward, done = env.step(action)
            model.rewards.append(reward)
            ep_reward += reward
            if done:
                break
        running_reward = 0.05 * ep_reward + (1 - 0.05) * running_reward
        losses.append(finish_episode())
        lengths.append(t)
        if i_episode % 4 == 0:
            print(f"Episode {i_episode}\tLast reward: {ep_reward:.2f}\t"
                  f"Average reward: {running_reward:.2f}")
    return {"losses": losses, "lengths": lengths, "running_reward": running_reward,
            "params": model.state_dict()}


if __name__ == "__main__":
    result = main()
    if len(sys.argv) > 1:  # the corpus runner compares what an eager run saved
        torch.save(result, sys.argv[1])
